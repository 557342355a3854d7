"""Real SGLang re-exports `utils.common` here; the stand-in re-exports what it has."""
from sglang.srt.utils.common import (  # noqa: F401
    MultiprocessingSerializer,
    SafeUnpickler,
    normalize_serialized_named_tensor_payload,
    normalize_serialized_named_tensor_payloads,
)
