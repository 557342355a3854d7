"""Full policy weights from FSDP2 shards, in size-bounded buckets.

An inference engine with its own copy of the weights (SGLang, a separate native
engine) receives them bucket by bucket: the extra memory at any moment is one
bucket of gathered tensors, not a second full model.
"""
from __future__ import annotations

from typing import Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """All-gather a DTensor (a collective: every rank must call it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def iter_weight_buckets(model: torch.nn.Module, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Yield lists of (name, full tensor) whose total size stays under `bucket_bytes`
    (a single tensor larger than the bound forms a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, param in model.named_parameters():
        t = full_tensor(param.detach())
        if dtype is not None:
            t = t.to(dtype)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
