"""The rollout-engine contract, shared by every engine.

An engine turns prompt token ids into completions and knows how to take fresh
weights and give its memory back between rollouts. Engines are looked up by
name and imported lazily, so a GPU-only engine costs nothing where it is absent.
`native` decodes on the policy's own module (rollout/native.py); `sglang` drives an
SGLang engine that receives the weights as CUDA IPC handles (rollout/sglang.py); `vllm`
runs vLLM in the trainer's own processes, weights reloaded in place (rollout/vllm.py).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import torch

TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop_token_ids: tuple[int, ...] = ()  # EOS is always a stop token
    greedy: bool = False
    seed: int = 0
    min_new_tokens: int = 0  # no stop token (EOS or stop_token_ids) before this many tokens (vLLM's min_tokens)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}; use greedy=True for argmax decoding")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Completion:
    """One sampled continuation.

    token_ids include the stop token when one was produced. logprobs[i] is the
    log-probability of token_ids[i] under log_softmax(logits / temperature), before
    top-k / top-p filtering (SGLang's convention).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def response_bodies(completions: Sequence[Completion], stop_ids: set[int]) -> list[list[int]]:
    """Each completion's tokens without a final stop token: what rewards and validation read."""
    return [c.token_ids[:-1] if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in stop_ids
            else c.token_ids for c in completions]


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in the order of `prompt_ids`: callers match them by position."""
        ...

    def begin_weight_update(self) -> None:
        """Open a weight sync (SGLang 0.5.21 loads weights only inside one); the buckets follow."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of (name, full tensor); every rank of an engine group passes the same names."""
        ...

    def end_weight_update(self) -> None:
        """Close the sync; an engine may refuse if a parameter was not sent."""
        ...

    def abort_weight_update(self) -> None:
        """Close a sync an exception interrupted, unchecked (nothing if none is open); the next sync sends all."""
        ...

    def memory_bytes(self) -> dict[str, int]:
        """Engine-owned bytes on this rank's device: {"engine_weights": ..., "kv_cache": ...}."""
        ...

    def release(self, tags: Sequence[str]) -> None: ...

    def resume(self, tags: Sequence[str]) -> None: ...


_ENGINES = {
    "native": "hybrid_rl.rollout.native:NativeEngine",
    "sglang": "hybrid_rl.rollout.sglang:SGLangEngine",
    "vllm": "hybrid_rl.rollout.vllm:VLLMEngine",
}


def engine_class(name: str) -> type:
    """Resolve an engine by name, importing its module only now."""
    if name not in _ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; valid: {sorted(_ENGINES)}")
    module, cls = _ENGINES[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as err:
        # Both modules import with the core install (sglang.py imports SGLang itself lazily); this is a guard.
        raise ImportError(f"rollout engine {name!r} is not available here ({err}); install its dependencies "
                          "(GPU engines: pip install 'hybrid_rl[gpu]')") from err


def check_tags(tags: Sequence[str]) -> None:
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tag(s) {bad}; valid: {list(TAGS)}")
