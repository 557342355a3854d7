"""Batched reward functions and their registry.

A reward function scores a batch: (prompts, completions, metadata) -> list[float],
one float per completion. `metadata[i]` holds the dataset row's own metadata plus
`finish_reason` ("stop" | "length") and `response_tokens` (count, stop token excluded).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[dict]], Sequence[float]]


@dataclass(frozen=True)
class RewardSpec:
    fn: RewardFn
    success_threshold: float = 1.0  # a reward at or above this counts as correct (accuracy metric)


_REGISTRY: dict[str, RewardSpec] = {}


def register_reward(name: str, success_threshold: float = 1.0) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward function {name!r} is already registered")
        _REGISTRY[name] = RewardSpec(fn, success_threshold)
        return fn

    return deco


def get_reward(name: str) -> RewardSpec:
    import hybrid_rl.rewards.toy  # noqa: F401  (registers the built-in tasks)

    if name not in _REGISTRY:
        raise ValueError(f"unknown reward function {name!r} (config key 'reward.name'); registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def compute_rewards(name: str, spec: RewardSpec, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]) -> list[float]:
    """Call a reward function and check what it returns; never silently drops a sample."""
    try:
        out = spec.fn(prompts, completions, metadata)
    except Exception as err:
        raise RuntimeError(f"reward function {name!r} raised {type(err).__name__}: {err}; fix the function "
                           "(it must return one float per completion)") from err
    out = list(out)
    if len(out) != len(completions):
        raise ValueError(f"reward function {name!r} returned {len(out)} rewards for {len(completions)} completions")
    for i, r in enumerate(out):
        if not isinstance(r, (int, float)) or math.isnan(r) or math.isinf(r):
            raise ValueError(f"reward function {name!r} returned {r!r} for completion {i} "
                             f"({completions[i]!r}); rewards must be finite floats")
    return [float(r) for r in out]
