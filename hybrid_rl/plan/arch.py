"""A decoder-only model's numbers for the memory planner: architecture, built-in names, parameter count.

Pure Python (no torch import), like plan/memory.py, which re-exports these names.

Parameter count N (``count_parameters``): exact, from the architecture:
  embeddings V*h; per layer q h*(H*d) [+H*d bias], k and v h*(K*d) [+K*d bias]
  each (GQA: K kv heads), o (H*d)*h [+h bias], MLP gate/up/down 3*h*I
  [+2I+h bias], two RMSNorm weights 2h [+ q/k norms 2d for Qwen3]; final norm h;
  lm_head V*h unless tie_word_embeddings; a sequence classifier (a reward
  model, ``num_labels`` > 0) has a score head C*h (C labels, no bias) instead of
  the lm_head.  (h hidden, I intermediate, V vocab, H heads, d head_dim.)  Qwen2 has q/k/v bias; Llama has none unless
  ``attention_bias``/``mlp_bias``.  ``ModelArch.num_params`` overrides the count
  (``--params 70e9``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ModelArch", "BUILTIN_ARCHS", "builtin_arch", "load_arch", "count_parameters"]

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelArch:
    """Decoder-only (Llama/Qwen2/Qwen3-style) architecture numbers.

    All fields may be 0 when ``num_params`` is given (a bare parameter count);
    the KV cache then needs num_hidden_layers, num_key_value_heads, head_dim."""

    name: str = "custom"
    hidden_size: int = 0
    intermediate_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v
    o_bias: bool = False  # Llama attention_bias=True: bias on o as well
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k (head_dim weights each)
    head_dim_: int = 0  # explicit head_dim (0: hidden_size // num_attention_heads)
    max_position_embeddings: int = 0
    num_params: int | None = None  # overrides count_parameters
    num_labels: int = 0  # > 0: a sequence classifier (reward model), score head C*h instead of the lm_head

    @property
    def head_dim(self) -> int:
        if self.head_dim_:
            return self.head_dim_
        return self.hidden_size // self.num_attention_heads if self.num_attention_heads else 0

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def has_kv_dims(self) -> bool:
        return self.num_hidden_layers > 0 and self.kv_heads > 0 and self.head_dim > 0

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any] | str | os.PathLike, name: str | None = None) -> "ModelArch":
        """Build from a HF config dict, a config.json path, or a directory holding one."""
        source = "<dict>"
        if not isinstance(cfg, Mapping):
            path = os.fspath(cfg)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ValueError(f"config file not found: {path}")
            with open(path) as f:
                try:
                    cfg = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} is not valid JSON: {e}") from None
            source = path
            name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "custom"
        d = dict(cfg)
        if "text_config" in d and "hidden_size" not in d:  # multimodal wrappers
            d = dict(d["text_config"])
        missing = [k for k in _REQUIRED if d.get(k) in (None, "")]
        if missing:
            raise ValueError(f"HF config {source} is missing required key(s): {', '.join(missing)}")
        mtype = str(d.get("model_type", "")).lower()
        attn_bias = bool(d.get("attention_bias", False))
        archs = cfg.get("architectures") or d.get("architectures") or []
        classifier = any(str(a).endswith("ForSequenceClassification") for a in archs)
        # transformers' own count: the label names if given, else num_labels, else 2.
        labels = (len(d["id2label"]) if d.get("id2label") else int(d.get("num_labels") or 2)) if classifier else 0
        return cls(
            name=name or d.get("_name_or_path") or mtype or "custom",
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            vocab_size=int(d["vocab_size"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=(mtype == "qwen2") or attn_bias,
            o_bias=attn_bias and mtype != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=mtype.startswith("qwen3"),
            head_dim_=int(d.get("head_dim") or 0),
            max_position_embeddings=int(d.get("max_position_embeddings") or 0),
            num_labels=labels,
        )


def _qwen2(name, h, i, layers, heads, kv, vocab, tie, maxpos=32768):
    return ModelArch(name, h, i, layers, heads, kv, vocab, tie, qkv_bias=True, max_position_embeddings=maxpos)


def _llama(name, h, i, layers, heads, kv, vocab=128256, maxpos=8192):
    return ModelArch(name, h, i, layers, heads, kv, vocab, False, max_position_embeddings=maxpos)


BUILTIN_ARCHS: dict[str, ModelArch] = {
    a.name: a
    for a in (
        _qwen2("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True),
        _qwen2("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, True),
        _qwen2("Qwen2.5-3B", 2048, 11008, 36, 16, 2, 151936, True),
        _qwen2("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, False),
        _qwen2("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 152064, False),
        _qwen2("Qwen2.5-32B", 5120, 27648, 64, 40, 8, 152064, False),
        _qwen2("Qwen2.5-72B", 8192, 29568, 80, 64, 8, 152064, False),
        _llama("Llama-3-8B", 4096, 14336, 32, 32, 8),
        _llama("Llama-3-70B", 8192, 28672, 80, 64, 8),
    )
}


def builtin_arch(name: str) -> ModelArch:
    """Built-in architecture by name (case-insensitive, "-Instruct" suffix ignored)."""
    key = name.strip().lower().removesuffix("-instruct").split("/")[-1]
    for k, a in BUILTIN_ARCHS.items():
        if k.lower() == key:
            return a
    raise ValueError(
        f"unknown built-in model {name!r}; built-in names: {', '.join(BUILTIN_ARCHS)}"
        " (or pass a path to a HF config.json / model directory)"
    )


def load_arch(spec: str) -> ModelArch:
    """A built-in name, a config.json path, or a directory containing config.json."""
    if os.path.exists(spec):
        return ModelArch.from_hf_config(spec)
    return builtin_arch(spec)


def count_parameters(arch: ModelArch) -> int:
    """Exact parameter count of the architecture (see module docstring)."""
    if arch.num_params is not None:
        return int(arch.num_params)
    missing = [k for k in _REQUIRED if not getattr(arch, k)]
    if missing:
        raise ValueError(f"architecture {arch.name!r} lacks {', '.join(missing)}; cannot count parameters")
    h, i, v, d = arch.hidden_size, arch.intermediate_size, arch.vocab_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.kv_heads * d
    attn = h * q + 2 * h * kv + q * h
    if arch.qkv_bias:
        attn += q + 2 * kv
    if arch.o_bias:
        attn += h
    mlp = 3 * h * i + ((2 * i + h) if arch.mlp_bias else 0)
    norms = 2 * h + (2 * d if arch.qk_norm else 0)
    layer = attn + mlp + norms
    embed = v * h
    head = arch.num_labels * h if arch.num_labels else (0 if arch.tie_word_embeddings else embed)
    return embed + arch.num_hidden_layers * layer + h + head


# The linear layers of a decoder layer, by the names Llama/Qwen use (peft's target_modules entries).
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_param_count(arch: ModelArch, rank: int, target_modules: Any = "all-linear") -> int:
    """Adapter parameters of LoRA at `rank` on `target_modules` ("all-linear": every linear layer but the LM head,
    or projection names): rank x (in + out) per adapted layer, as peft builds them (A: rank x in, B: out x rank).
    Names other than the seven projections add nothing here (models/lora.py refuses those that match no layer)."""
    h, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.kv_heads * arch.head_dim
    widths = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    names = LORA_PROJECTIONS if target_modules == "all-linear" else [t for t in target_modules if t in widths]
    return arch.num_hidden_layers * sum(rank * sum(widths[t]) for t in names)


def critic_param_count(arch: ModelArch) -> int:
    """Parameters of PPO's critic over `arch` (models/value.py): the body without its LM head, and a value head of
    h weights and one bias."""
    if arch.num_params is not None:
        return int(arch.num_params)
    return count_parameters(dataclasses.replace(arch, num_labels=1, tie_word_embeddings=False)) + 1


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]
