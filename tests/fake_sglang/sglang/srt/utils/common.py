"""Serialization for weight transfer (`srt/utils/common.py`, note 2.1).

`serialize` is ForkingPickler, so CPU tensors travel as shared-memory handles
(`rebuild_storage_fd` + `DupFd`, or `rebuild_storage_filename` under the
"file_system" strategy) and CUDA tensors as CUDA-IPC handles. `deserialize`
resolves globals only from an exact allow-list of (module, name) pairs, so a
DTensor, a numpy array or any custom class fails here exactly as it would in
SGLang: send plain, detached, full tensors with python / torch.Size / torch.dtype
metadata.
"""
from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import List, Union

import torch
import torch._utils
import torch.multiprocessing.reductions

SerializedTensorPayload = Union[str, bytes, bytearray, memoryview]


def _names(module, prefix: str) -> set:
    # The names are enumerated once, so the check below stays an exact pair lookup.
    return {n for n in dir(module) if n.startswith(prefix)}


def _build_allow_list() -> frozenset:
    pairs = set()
    for name in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool",
                 "str", "bytes", "bytearray", "slice", "range"):
        pairs.add(("builtins", name))
    for name in ("OrderedDict", "defaultdict", "deque", "Counter"):
        pairs.add(("collections", name))
    pairs.add(("copyreg", "__newobj__"))
    pairs |= {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    pairs |= {("torch", n) for n in dir(torch) if n.endswith("Storage")}
    pairs |= {("torch", "Tensor"), ("torch", "Size"), ("torch._tensor", "Tensor"),
              ("torch.nn.parameter", "Parameter"),
              ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage")}
    pairs |= {("torch._utils", n) for n in _names(torch._utils, "_rebuild_")}
    pairs |= {("torch.multiprocessing.reductions", n)
              for n in _names(torch.multiprocessing.reductions, "rebuild_")}
    pairs |= {
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("multiprocessing.resource_sharer", "DupFd"),
        ("multiprocessing.reduction", "_rebuild_partial"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
        # Both paths are allowed, but 0.5.21 only defines the class at the second one,
        # so a payload pickled against the old path fails with AttributeError (note 7).
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
        ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
    }
    return frozenset(pairs)


_ALLOWED_GLOBALS = _build_allow_list()


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only allow-listed (module, name) pairs."""

    ALLOWED_GLOBALS = _ALLOWED_GLOBALS

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(
            f"Blocked unsafe global {module}.{name} while deserializing a weight payload: only plain "
            "tensors, python containers, torch.Size/torch.dtype and SGLang's bucket classes are allowed"
        )


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        """ForkingPickler bytes of `obj` (base64 text if output_str).

        Side effect of the real transport: every CPU tensor's storage is moved into
        shared memory in place (note 2.4), so serialize a clone, not a live parameter.
        """
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode("utf-8") if output_str else data

    @staticmethod
    def deserialize(data):
        """Inverse of serialize; a str is base64 text. Opens the shared-memory handles."""
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        return SafeUnpickler(io.BytesIO(data)).load()


def _looks_like_pickle(data: bytes) -> bool:
    # Protocol 2+ pickles start with PROTO (0x80) and a protocol number; base64 text never does.
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= pickle.HIGHEST_PROTOCOL


def normalize_serialized_named_tensor_payload(payload: SerializedTensorPayload) -> bytes:
    """Raw pickle bytes for one per-rank payload: pickle bytes are kept, the rest is base64."""
    if isinstance(payload, (bytearray, memoryview)):
        payload = bytes(payload)
    if isinstance(payload, bytes):
        return payload if _looks_like_pickle(payload) else base64.b64decode(payload, validate=True)
    if isinstance(payload, str):
        return base64.b64decode(payload, validate=True)
    raise TypeError(f"a serialized payload must be str, bytes, bytearray or memoryview, got {type(payload).__name__}")


def normalize_serialized_named_tensor_payloads(payloads: List[SerializedTensorPayload]) -> List[bytes]:
    return [normalize_serialized_named_tensor_payload(p) for p in payloads]
