"""Weights to SGLang as handles, not bytes: one flat bucket per rank, serialized once.

Each trainer rank holds the full tensors of a bucket (FSDP2 `full_tensor()`), copies
them into ONE new uint8 buffer plus metadata (SGLang's `flattened_bucket` format:
one handle per bucket instead of one per tensor, 2-4x faster to open), and
serializes that with SGLang's `MultiprocessingSerializer`. What crosses the process
boundary is a handle: a CUDA IPC handle on GPU, a shared-memory file on CPU. The
SGLang scheduler of TP rank i opens trainer rank g0+i's payload, exactly once.

Rules from sglang-api.md that shape this file:
  * the buffer is fresh per bucket and stays alive until the engine's call has
    returned on the owner (the caller keeps the returned `Export` until then);
  * `monkey_patch_torch_reductions()` only for CUDA tensors (it breaks CPU export);
  * CPU tensors use the `file_system` sharing strategy (for the export only): the default fd strategy hands
    the descriptor over through the producer's resource-sharer socket, which only a
    process holding the producer's multiprocessing authkey may claim, and the
    scheduler is a child of ANOTHER trainer rank;
  * only plain tensors and python metadata travel: SGLang's unpickler has an allow-list.
This module imports `sglang` lazily (GPU extra), like rollout/sglang/engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hybrid_rl.runtime import distributed as D


@dataclass
class Export:
    """One rank's serialized bucket; `buffer` must outlive the engine call that opens `payload`."""

    payload: bytes
    buffer: torch.Tensor  # the flat uint8 buffer the handle points at
    nbytes: int


def export_bucket(named_tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> Export:
    """Flatten `named_tensors` (cast to `dtype`) into one new buffer and serialize its handle."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if not named_tensors:
        raise ValueError("an empty bucket cannot be exported")
    tensors = []
    for name, t in named_tensors:
        if hasattr(t, "full_tensor"):
            raise TypeError(
                f"{name}: a DTensor cannot cross to SGLang (its unpickler refuses it); "
                "send full_tensor() of every parameter"
            )
        tensors.append((name, t.detach().to(dtype) if dtype is not None else t.detach()))
    device = tensors[0][1].device
    if any(t.device != device for _, t in tensors):
        raise ValueError("a bucket's tensors must be on one device (the engine rank's GPU)")
    if device.type == "cuda":
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        # Device uuids instead of indices: producer and scheduler may number GPUs differently.
        monkey_patch_torch_reductions()
    bucket = FlattenedTensorBucket(named_tensors=tensors)  # a copy: the source may be freed or reused
    flat = bucket.get_flattened_tensor()
    # The strategy is process-wide and read when a tensor is pickled: switched for this export only, so
    # the caller's own torch.multiprocessing traffic (a DataLoader, a notebook's queues) keeps its own.
    strategy = torch.multiprocessing.get_sharing_strategy()
    if device.type != "cuda":
        torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        payload = MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": bucket.get_metadata()})
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return Export(payload=payload, buffer=flat, nbytes=flat.numel())


def collect_ipc() -> None:
    """After the engine call returned and the buffers were dropped: free CUDA IPC limbo blocks."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()


def push_bucket(
    named_tensors: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None,
    owner: int,
    group,
    send: Callable[[Optional[list]], None],
) -> int:
    """Export one bucket on every rank of an engine's group, gather the payloads on the `owner` and call
    `send(payloads)` on every rank (the owner's call hands them to SGLang); the buffer is freed only after
    that call returned (the rule above, sglang#6626). Returns one rank's bytes."""
    export = export_bucket(named_tensors, dtype)
    try:
        send(D.gather_object_to(export.payload, owner, group))
    finally:
        nbytes = export.nbytes
        del export
        collect_ipc()
    return nbytes
