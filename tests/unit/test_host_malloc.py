"""Freed host buffers are kept for reuse on CPU (host_malloc.py): a step stops page-faulting them back."""
from __future__ import annotations

import subprocess
import sys

import pytest

# One round: six 6 MiB blocks allocated as torch's CPU allocator does (posix_memalign, 64-byte
# alignment), every page written, then freed last-first: a step's activations and their release,
# without torch (whose own small allocations between the blocks make the count vary run to run).
# By default glibc serves each block by mmap and unmaps it on free (its dynamic threshold never
# rises past a block that size), so every round faults every page in again; kept, the blocks come
# from the heap, merge into its top on free and are reused by the next round.
_ROUNDS = """
import ctypes, resource, sys
from hybrid_rl.host_malloc import keep_freed_blocks
applied = keep_freed_blocks() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
SIZE, BLOCKS = 6 << 20, 6
def one_round():
    blocks = []
    for _ in range(BLOCKS):
        p = ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(p), 64, SIZE) == 0
        libc.memset(p, 1, SIZE)
        blocks.append(p)
    for p in reversed(blocks):
        libc.free(p)
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    one_round()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_PER_ROUND = 6 * (6 << 20) // 4096


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_kept_blocks_are_reused_instead_of_faulted_back():
    """Ten rounds: by default nearly every page faults in every round (88,861 of 92,160 measured);
    kept, at most one round's worth in all (1,536 measured, the same in every run)."""
    _, default = _faults("default")
    applied, kept = _faults("keep")
    assert applied == "True"
    assert default > 5 * PAGES_PER_ROUND, f"glibc's defaults faulted only {default} pages in 10 rounds"
    assert kept < PAGES_PER_ROUND, f"{kept} page faults in 10 rounds with freed blocks kept ({default} without)"


def test_the_trainer_keeps_host_memory_on_cpu_unless_told_not_to(monkeypatch, tmp_path):
    from hybrid_rl import trainer as trainer_module
    from hybrid_rl.config import load_config

    calls = []
    monkeypatch.setattr(trainer_module, "keep_freed_blocks", lambda: calls.append(1) or True)

    class Stop(Exception):
        pass

    def stop_after_init(*args, **kwargs):
        raise Stop

    # Stop right after the device and allocator are set up: nothing else is needed here.
    monkeypatch.setattr(trainer_module.Config, "validate_runtime", stop_after_init)
    for keep, expected in ((True, 1), (False, 0)):
        calls.clear()
        cfg = load_config(None, [f"trainer.out_dir={tmp_path}", "trainer.device=cpu",
                                 f"trainer.keep_host_memory={str(keep).lower()}"])
        with pytest.raises(Stop):
            trainer_module.Trainer(cfg)
        assert len(calls) == expected
