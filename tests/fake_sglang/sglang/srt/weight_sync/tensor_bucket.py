"""FlattenedTensorBucket (`srt/weight_sync/tensor_bucket.py`, note 2.3).

One bucket is one new uint8 tensor (a copy made by `torch.cat`) holding the raw bytes
of every tensor, plus metadata with byte offsets, so a bucket needs one IPC handle
instead of one per tensor. Mixed dtypes are allowed. Wire format per TP rank:
`serialize({"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()})`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int  # byte offset into the flattened uint8 tensor
    end_idx: int
    numel: int  # bytes, i.e. end_idx - start_idx


class FlattenedTensorBucket:
    # Callers probe this to decide whether one bucket may mix dtypes.
    supports_multi_dtypes = True

    def __init__(self, named_tensors: Optional[List[Tuple[str, torch.Tensor]]] = None,
                 flattened_tensor: Optional[torch.Tensor] = None,
                 metadata: Optional[List[FlattenedTensorMetadata]] = None):
        """Build from `named_tensors`, or wrap a received `flattened_tensor` + `metadata`."""
        if named_tensors is None:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor = flattened_tensor
            self.metadata = metadata
            return
        if not named_tensors:
            raise ValueError("Cannot create empty tensor bucket")
        pieces, self.metadata, offset = [], [], 0
        for name, tensor in named_tensors:
            # flatten() copies a non-contiguous tensor; view(uint8) then exposes its bytes.
            raw = tensor.flatten().view(torch.uint8)
            pieces.append(raw)
            self.metadata.append(FlattenedTensorMetadata(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                                         start_idx=offset, end_idx=offset + raw.numel(),
                                                         numel=raw.numel()))
            offset += raw.numel()
        self.flattened_tensor = torch.cat(pieces, dim=0)

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> List[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """(name, tensor) pairs that are views into the flattened tensor (no copy)."""
        return [(m.name, self.flattened_tensor[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                for m in self.metadata]
