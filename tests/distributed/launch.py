"""Run a function on W real gloo ranks (spawned processes) with hard timeouts.

Each rank gets the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), so the
library's own `distributed.init()` is what joins the group. A rank that dies or
hangs fails the test instead of hanging CI.
"""

from __future__ import annotations

import io
import os
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from hybrid_rl.runtime.distributed import free_port


def _entry(fn: Callable, rank: int, world: int, port: int, out_q, args: tuple) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    try:
        # Tensors go back as torch.save bytes: a queue would pass them as shared-memory
        # handles that die with this process.
        buf = io.BytesIO()
        torch.save(fn(rank, *args), buf)
        out_q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        out_q.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int = 2, args: tuple = (), timeout: float = 240.0) -> list[Any]:
    """Return [fn(rank, *args) for each rank]; raise with the rank's traceback on failure."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = q.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
