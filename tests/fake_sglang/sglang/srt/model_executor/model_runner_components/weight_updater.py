"""LocalSerializedTensor (`model_executor/model_runner_components/weight_updater.py`, note 2.5).

The non-flattened way to give each TP rank its own copy of one tensor:
`(name, LocalSerializedTensor(values=[bytes_for_rank0, bytes_for_rank1, ...]))`.
Rank r deserializes only `values[r]`, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from sglang.srt.utils.common import MultiprocessingSerializer


@dataclass
class LocalSerializedTensor:
    values: List[bytes]

    def get(self, rank: int):
        return MultiprocessingSerializer.deserialize(self.values[rank])
