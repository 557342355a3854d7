"""Serialization for weight transfer (`srt/utils/common.py`, note 2.1).

`serialize` is ForkingPickler, so CPU tensors travel as shared-memory handles
(`rebuild_storage_fd` + `DupFd`, or `rebuild_storage_filename` under the
"file_system" strategy) and CUDA tensors as CUDA-IPC handles. `deserialize`
resolves globals only from 0.5.21's exact allow-list of (module, name) pairs
(`SafeUnpickler.ALLOWED_GLOBALS`, each pair named there; no wildcard), so a DTensor,
a numpy array or any custom class fails here exactly as it would in SGLang. The one
exception to the list is torch.storage._load_from_bytes, which SGLang swaps for a
`torch.load(weights_only=True)` that must return a storage.
"""
from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import List, Union

import torch

SerializedTensorPayload = Union[str, bytes, bytearray, memoryview]

# The legacy tensor and storage type names, grouped by the modules 0.5.21 admits them from.
_TENSOR_TYPES = ("BFloat16", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
_STORAGE_TYPES = ("BFloat16", "Bool", "Byte", "Char", "ComplexDouble", "ComplexFloat", "Double", "Float",
                  "Half", "Int", "Long", "Short")
_DTYPES = ("bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat",
           "chalf", "complex128", "complex32", "complex64", "double", "float", "float16", "float32",
           "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
           "float8_e8m0fnu", "half", "int", "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6",
           "int64", "int7", "int8", "long", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "short",
           "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8")


def _build_allow_list() -> frozenset:
    pairs = {("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset",
                                       "int", "list", "range", "set", "slice", "str", "tuple")}
    pairs |= {("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")}
    pairs |= {("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("functools", "partial"),
              ("itertools", "chain"), ("itertools", "repeat"), ("types", "SimpleNamespace"), ("_codecs", "encode"),
              ("multiprocessing.reduction", "_rebuild_partial"), ("multiprocessing.reduction", "_rebuild_socket"),
              ("multiprocessing.resource_sharer", "DupFd")}
    # Tensors: the class, the legacy typed classes (Bool has no sparse variant), Size, device, dtypes.
    pairs |= {("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
              ("torch", "BoolTensor"), ("torch.cuda", "BoolTensor"), ("torch.nn.parameter", "Parameter"),
              ("torch.serialization", "_get_layout"), ("torch._tensor", "_rebuild_from_type_v2")}
    pairs |= {(m, t + "Tensor") for m in ("torch", "torch.cuda", "torch.sparse", "torch.cuda.sparse")
              for t in _TENSOR_TYPES}
    pairs |= {("torch", n) for n in _DTYPES}
    pairs |= {("torch", n) for n in ("per_tensor_affine", "per_tensor_symmetric", "per_channel_affine",
                                     "per_channel_symmetric", "per_channel_affine_float_qparams")}
    pairs |= {("torch._utils", "_rebuild_" + n) for n in (
        "tensor", "tensor_v2", "tensor_v3", "parameter", "parameter_with_state", "qtensor", "sparse_tensor",
        "meta_tensor_no_storage", "wrapper_subclass", "device_tensor_from_numpy", "device_tensor_from_cpu_tensor")}
    # Storages: untyped under three names, typed ones from torch (with the quantized) and torch.cuda.
    pairs |= {("torch.storage", "UntypedStorage"), ("torch.storage", "_UntypedStorage"),
              ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage")}
    pairs |= {("torch", t + "Storage") for t in _STORAGE_TYPES + ("QInt32", "QInt8", "QUInt2x4", "QUInt4x2", "QUInt8")}
    pairs |= {("torch.cuda", t + "Storage") for t in _STORAGE_TYPES}
    pairs |= {("torch.multiprocessing.reductions", "rebuild_" + n) for n in (
        "tensor", "meta_tensor", "cuda_tensor", "nested_tensor", "sparse_coo_tensor", "sparse_compressed_tensor",
        "storage_fd", "storage_filename", "storage_empty", "typed_storage", "typed_storage_child")}
    pairs |= {
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("sglang.srt.utils.patch_torch", "_rebuild_npu_tensor_modified"),
        ("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor"),
        # SGLang's data containers only, never its code modules.
        ("sglang.srt.managers.io_struct", "GenerateReqInput"),
        ("sglang.srt.managers.io_struct", "EmbeddingReqInput"),
        ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
        ("sglang.srt.managers.schedule_batch", "Modality"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
        # Both paths are allowed, but 0.5.21 only defines the class at the second one,
        # so a payload pickled against the old path fails with AttributeError (note 7).
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
        ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
    }
    return frozenset(pairs)


_ALLOWED_GLOBALS = _build_allow_list()


def _safe_load_torch_storage(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only allow-listed (module, name) pairs."""

    ALLOWED_GLOBALS = _ALLOWED_GLOBALS

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _safe_load_torch_storage  # torch's own helper would run an unrestricted torch.load
        if (module, name) in self.ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


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
    # A PROTO opcode (0x80) and any protocol number up to the highest; base64 text never starts so.
    return len(data) >= 2 and data[0] == 0x80 and data[1] <= pickle.HIGHEST_PROTOCOL


def normalize_serialized_named_tensor_payload(payload: SerializedTensorPayload) -> bytes:
    """Raw pickle bytes for one per-rank payload. A str is base64 (strictly); bytes-like data is
    kept when it starts like a pickle, else base64-decoded, and kept as it is when that fails
    (a protocol 0/1 pickle has no PROTO header): SGLang then lets the unpickler judge it."""
    if isinstance(payload, str):
        return base64.b64decode(payload, validate=True)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        payload = bytes(payload)
        if _looks_like_pickle(payload):
            return payload
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            return payload
    raise TypeError("serialized_named_tensors entries must be base64 strings or bytes-like payloads, "
                    f"got {type(payload).__name__}")


def normalize_serialized_named_tensor_payloads(payloads: List[SerializedTensorPayload]) -> List[bytes]:
    return [normalize_serialized_named_tensor_payload(p) for p in payloads]
