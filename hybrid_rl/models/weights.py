"""Full policy weights from FSDP2 shards, in size-bounded buckets.

An inference engine with its own copy of the weights (SGLang, a separate native
engine) receives them bucket by bucket: the extra memory at any moment is one
bucket of gathered tensors, not a second full model.

Each shard is cast to the engine's dtype before the all-gather, not after: gathering
fp32 masters and casting the full tensor to bf16 moves (and briefly holds) twice the
bytes of every sync. The cast is elementwise, so the result is the same to the bit.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

Bucket = list[tuple[str, torch.Tensor]]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """All-gather a DTensor (a collective: every rank must call it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def engine_dtype(engine) -> Optional[torch.dtype]:
    """The dtype an engine with its own copy loads weights in: its `dtype` attribute when it
    declares one (the SGLang adapter does), else None (the sync sends the policy's dtype and
    the engine casts)."""
    dtype = getattr(engine, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def iter_weight_buckets(
    model: torch.nn.Module,
    bucket_bytes: int = 256 << 20,
    dtype: torch.dtype | None = None,
    named: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
) -> Iterator[Bucket]:
    """Yield lists of (name, full tensor) whose total size stays under `bucket_bytes`
    (a single tensor larger than the bound forms a bucket of its own).

    dtype: what the tensors arrive in (None: each parameter's own); sharded parameters are
    cast on each rank's shard, so the all-gather moves numel x dtype's size bytes.
    named: the (name, parameter) pairs to send (default: `model.named_parameters()`; with LoRA the
    frozen base under its own names, `models.lora.base_named_parameters`)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, param in model.named_parameters() if named is None else named:
        t = param.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)  # a DTensor casts its local shard and keeps its placements
        t = full_tensor(t)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
