"""Per-request sampling parameters (`srt/sampling/sampling_params.py`, note 1.3).

Field names and defaults follow 0.5.21; an unknown key is a TypeError, as with the
real msgspec Struct. Fields the stand-in does not implement are accepted at their
default value and refused otherwise, so a test never passes on a feature that the
stand-in silently ignored.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Union

# 0 <= temperature < this means greedy (top_k = 1, logprobs at T = 1).
_GREEDY_EPS = 1e-6
# sampling_seed used when enable_deterministic_inference is on and a request gives none.
# Unverified against the source: any fixed value gives the same behaviour.
DEFAULT_SAMPLING_SEED = 42

_UNIMPLEMENTED_DEFAULTS = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "stop_regex": None, "logit_bias": None, "custom_params": None,
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: Optional[Dict[str, Any]] = None
    stream_interval: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    sampling_seed: Optional[int] = None

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError on an invalid value (the real `verify`), NotImplementedError
        on a feature the stand-in lacks."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if self.max_new_tokens is None or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                             f"got {self.min_new_tokens}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for tid in self.stop_token_ids or []:
            if not 0 <= int(tid) < vocab_size:
                raise ValueError(f"stop_token_ids entry {tid} is outside the vocabulary (size {vocab_size}).")
        for key, default in _UNIMPLEMENTED_DEFAULTS.items():
            if getattr(self, key) != default:
                raise NotImplementedError(f"the sglang stand-in does not implement sampling param {key!r}")

    def check_tokenizer(self, tokenizer: Any) -> None:
        """0.5.21's raise_if_tokenizer_required (called from normalize, before verify): without a
        tokenizer (skip_tokenizer_init=True) stop strings and min_new_tokens are refused; the
        min-new-tokens penalizer reads the tokenizer's eos_token_id."""
        if tokenizer is not None:
            return
        if self.stop:
            raise ValueError(f"stop={self.stop!r} is unavailable when skip_tokenizer_init=True "
                             "(requires tokenizer to decode tokens to text for matching).")
        if self.min_new_tokens > 0:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} is unavailable when skip_tokenizer_init=True "
                             "(requires tokenizer for eos_token_id).")

    def normalized(self) -> Dict[str, Any]:
        """A plain dict for the scheduler, with greedy spelled out as SGLang does."""
        out = asdict(self)
        if self.temperature < _GREEDY_EPS:
            out["top_k"], out["temperature"] = 1, 1.0
        out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        out["stop_token_ids"] = [int(t) for t in self.stop_token_ids or []]
        return out
