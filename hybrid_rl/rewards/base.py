"""Batched reward functions and their registry.

A reward function scores a batch: (prompts, completions, metadata) -> list[float],
one float per completion. `metadata[i]` holds the dataset row's own metadata plus
`finish_reason` ("stop" | "length") and `response_tokens` (count, stop token excluded).

Registration is an import side effect: `@register_reward("name")` adds the function
to the registry when its module is imported, and `reward.name=name` selects it. The
built-in rewards live in `hybrid_rl.rewards.toy`, which `get_reward` imports itself,
so they need nothing from the user. A reward of your own must be registered before
`Trainer(cfg)` is built (its constructor calls `get_reward` and probes the function):
decorate it in your script, or in a module the script imports, above that line. Every
rank needs it; under torchrun every rank runs the same script, so that holds.

    from hybrid_rl.rewards.base import register_reward

    @register_reward("exact_match")  # e.g. for a jsonl dataset whose rows have "answer"
    def exact_match(prompts, completions, metadata):
        return [float(c.strip() == m["answer"]) for c, m in zip(completions, metadata)]

then run with `reward.name=exact_match`. `success_threshold` (default 1.0) is the
reward at or above which a sample counts as correct in the accuracy metric. Names
are unique: registering a taken name, a built-in one included, raises.
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


def _register_builtin_rewards() -> None:
    """Import the built-in reward modules; their @register_reward decorators fill the registry."""
    # Inside a function, not at the top: toy imports this module for register_reward.
    import hybrid_rl.rewards.toy  # noqa: F401  (imported for its side effect; Python imports it once)


def register_reward(name: str, success_threshold: float = 1.0) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` as reward `name` (selected by `reward.name=name`)."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward function {name!r} is already registered")
        _REGISTRY[name] = RewardSpec(fn, success_threshold)
        return fn

    return deco


def get_reward(name: str) -> RewardSpec:
    """The registered reward `name`; the built-in rewards are registered here, on first use."""
    _register_builtin_rewards()
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
