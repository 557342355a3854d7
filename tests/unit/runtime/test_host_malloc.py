"""Freed host buffers are kept for reuse on CPU (runtime/host_malloc.py): a step stops page-faulting them back."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Six 6 MiB blocks held at once, written, then freed last-first: a step's activations and their
# release. glibc's own accounting (mallinfo2) says where they lived and what the heap kept after
# the free. Page-fault counts would say the same less reliably: they also move with transparent
# huge pages and with where the kernel lets the heap grow, which differ from run to run.
_BLOCKS = """
import ctypes, sys
from hybrid_rl.runtime.host_malloc import keep_freed_blocks
applied = keep_freed_blocks() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
SIZE = 6 << 20
blocks = [libc.malloc(SIZE) for _ in range(6)]
for p in blocks:
    libc.memset(p, 1, SIZE)
mmapped_while_held = libc.mallinfo2().hblkhd  # bytes in blocks served by their own mmap
for p in reversed(blocks):
    libc.free(p)
print(applied, mmapped_while_held, libc.mallinfo2().arena)  # arena: bytes the heap still holds
"""
HELD = 6 * (6 << 20)


def _blocks(mode: str) -> tuple[str, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _BLOCKS, mode], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    return out[0], int(out[1]), int(out[2])


def _has_mallinfo2() -> bool:
    import ctypes

    return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc >= 2.33 (mallinfo2)")
def test_freed_blocks_stay_in_the_heap_for_the_next_step():
    """By default each block is its own mmap, unmapped on free (the next step faults it in again);
    kept, the blocks come from the heap and stay there after the free, ready for reuse."""
    _, mmapped, heap_after = _blocks("default")
    assert mmapped >= HELD and heap_after < HELD, (mmapped, heap_after)
    applied, mmapped, heap_after = _blocks("keep")
    assert applied == "True"
    assert mmapped < HELD // 6, f"{mmapped} bytes of the held blocks were mmapped with the thresholds raised"
    assert heap_after >= HELD, f"the heap kept only {heap_after} bytes after the blocks were freed"


def test_the_trainer_keeps_host_memory_on_cpu_unless_told_not_to(monkeypatch, tmp_path):
    from hybrid_rl import trainer as trainer_module
    from hybrid_rl.config.load import load_config

    calls = []
    monkeypatch.setattr(trainer_module, "keep_freed_blocks", lambda: calls.append(1) or True)

    class Stop(Exception):
        pass

    def stop_after_init(*args, **kwargs):
        raise Stop

    # Stop right after the device and allocator are set up: nothing else is needed here.
    monkeypatch.setattr(trainer_module, "validate_runtime", stop_after_init)
    for keep, expected in ((True, 1), (False, 0)):
        calls.clear()
        cfg = load_config(
            None, [f"trainer.out_dir={tmp_path}", "trainer.device=cpu", f"trainer.keep_host_memory={str(keep).lower()}"]
        )
        with pytest.raises(Stop):
            trainer_module.Trainer(cfg)
        assert len(calls) == expected
