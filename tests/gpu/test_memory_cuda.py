"""What the memory ledger's helpers do to the CUDA allocator (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_release_cached_gives_the_freed_blocks_back_to_the_device():
    """What an engine in another process (SGLang) can use: the allocator's cached blocks count as used there until
    `release_cached` hands them back (the phase switch calls it before such an engine resumes)."""
    from hybrid_rl.switch.memory import release_cached

    dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = 256 << 20
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    del x  # freed, but the allocator keeps the block
    assert torch.cuda.memory_reserved(dev) >= nbytes
    free = torch.cuda.mem_get_info(dev)[0]
    assert release_cached(dev) >= nbytes
    assert torch.cuda.mem_get_info(dev)[0] - free >= nbytes, "the driver must see the block free"
