"""On a GPU the offload must really free device memory and come back bit-exact (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_optimizer_offload_frees_device_memory_and_round_trips(tiny_model_dir):
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.switch.offload import OptimizerOffloader, optimizer_tensors

    dev = torch.device("cuda")
    model = load_causal_lm(tiny_model_dir).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[4, 5, 6]], device=dev)).logits.sum().backward()
    opt.step()
    state_bytes = sum(v.numel() * v.element_size() for _, _, v in optimizer_tensors(opt))
    before = [v.clone() for _, _, v in optimizer_tensors(opt)]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    pinned_blocks = _pinned_blocks()
    off = OptimizerOffloader(opt, dev)
    for _ in range(2):
        assert off.offload() == state_bytes
        assert allocated - torch.cuda.memory_allocated() >= state_bytes, "offload must free the device copies"
        assert all(v.is_pinned() for _, _, v in optimizer_tensors(opt))
        assert off._host.is_pinned()
        assert off.onload() == state_bytes
        assert all(torch.equal(a, b) for a, b in zip(before, (v for _, _, v in optimizer_tensors(opt))))
    if pinned_blocks is not None:
        # One pinned block for the whole state, made once: a block per state tensor (two per parameter) would each
        # be rounded up to a power of two and kept by torch's pinned allocator.
        assert _pinned_blocks() - pinned_blocks <= 1, "optimizer offload must use one flat pinned buffer"


def _pinned_blocks():
    """Pinned blocks torch's host allocator has made so far (None where this torch does not count them)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return None if stats is None else stats().get("num_host_alloc")


def _module_round_trips(model, dev) -> None:
    """Offload twice: device memory freed, host side pinned and the same buffer both times,
    non-blocking copies that land (the logits after each onload equal those before)."""
    from hybrid_rl.models.fsdp import reshard
    from hybrid_rl.switch.offload import ModuleOffloader

    ids = torch.tensor([[4, 5, 6, 7]], device=dev)
    with torch.no_grad():
        expected = model(input_ids=ids).logits.clone()
    reshard(model)  # FSDP2 keeps the root's parameters gathered after a forward; offload moves shards
    local = [t.to_local() if hasattr(t, "to_local") else t for t in [*model.parameters(), *model.buffers()]]
    nbytes = sum(t.numel() * t.element_size() for t in local)
    off = ModuleOffloader(model, dev)
    host = []
    for _ in range(2):
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        assert off.offload() == nbytes
        assert allocated - torch.cuda.memory_allocated() >= nbytes, "offload must free the device copies"
        assert off._host.is_pinned(), "host side must be pinned (a pageable copy back blocks)"
        host.append(off._host.data_ptr())
        assert off.onload() == nbytes
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, expected), "the module computes the same after a round trip"
    assert host[0] == host[1], "the pinned host buffer is allocated once and reused"


def test_module_offload_frees_device_memory_and_reuses_pinned_buffers(tiny_model_dir):
    from hybrid_rl.models.loading import load_causal_lm

    dev = torch.device("cuda")
    model = load_causal_lm(tiny_model_dir).to(dev)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    _module_round_trips(model, dev)
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())


def test_module_offload_of_an_fsdp2_model(tiny_model_dir):
    """FSDP2's shards: the DTensor parameters and the padded flat shard it all-gathers from share
    a storage, which the offloader empties and refills in place."""
    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.runtime import distributed as D

    dev = D.init("cuda", 120)
    try:
        model = shard_model(load_causal_lm(tiny_model_dir, dtype=torch.float32), dev, False)
        _module_round_trips(model, dev)
    finally:
        D.shutdown()
