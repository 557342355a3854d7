"""The rollout-engine contract, shared by every engine.

An engine turns prompt token ids into completions and knows how to take fresh
weights and give its memory back between rollouts. Engines are looked up by
name and imported lazily, so a GPU-only engine costs nothing where it is absent.
`native` decodes on the policy's own module (rollout/native/engine.py); `sglang` drives an
SGLang engine that receives the weights as CUDA IPC handles (rollout/sglang/engine.py); `vllm`
runs vLLM in the trainer's own processes, weights reloaded in place (rollout/vllm/engine.py).
"""

from __future__ import annotations

import importlib
from typing import Iterable, Protocol, Sequence

import torch

from hybrid_rl.types import Completion, PartialRequest, SamplingParams

TAGS = ("weights", "kv_cache")


class RolloutEngine(Protocol):
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, partial: PartialRequest | None = None
    ) -> list[Completion]:
        """One completion per prompt, in the order of `prompt_ids`: callers match them by position.

        partial (rollout.partial): per-row budgets and the early stop; unfinished rows come back "abort".
        After each call an engine sets `last_tail_s` (seconds of the call during which fewer than half of its
        rows were still decoding) and `last_generated_tokens` (tokens it sampled), or leaves them None."""
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
    "native": "hybrid_rl.rollout.native.engine:NativeEngine",
    "sglang": "hybrid_rl.rollout.sglang.engine:SGLangEngine",
    "vllm": "hybrid_rl.rollout.vllm.engine:VLLMEngine",
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
        raise ImportError(
            f"rollout engine {name!r} is not available here ({err}); install its dependencies "
            "(GPU engines: pip install 'hybrid_rl[gpu]')"
        ) from err


def check_tags(tags: Sequence[str]) -> None:
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tag(s) {bad}; valid: {list(TAGS)}")
