"""Batched reward functions and their registry.

A reward function scores a batch: (prompts, completions, metadata) -> list[float],
one float per completion. `metadata[i]` holds the dataset row's own metadata plus
`finish_reason` ("stop" | "length") and `response_tokens` (count, stop token excluded).

Registration is an import side effect: `@register_reward("name")` adds the function
to the registry when its module is imported, and `reward.name=name` selects it. The
built-in rewards live in `hybrid_rl.rewards.toy` (digits), `hybrid_rl.rewards.math` (gsm8k,
gsm8k_format) and `hybrid_rl.rewards.latex_math` (math: LaTeX answers via math-verify), which
`get_reward` imports itself, so they need nothing from the user. A reward of your own must be registered before
`Trainer(cfg)` is built (its constructor calls `get_reward` and probes the function):
decorate it in your script, or in a module the script imports, above that line. Every
rank needs it; under torchrun every rank runs the same script, so that holds.

    from hybrid_rl.rewards.base import register_reward

    @register_reward("exact_match")  # e.g. for a jsonl dataset whose rows have "answer"
    def exact_match(prompts, completions, metadata):
        return [float(c.strip() == m["answer"]) for c, m in zip(completions, metadata)]

then run with `reward.name=exact_match`. `success_threshold` (default 1.0) is the
reward at or above which a sample counts as correct in the accuracy metric. Names
are unique: registering a taken name, a built-in one included, raises. `check_rows`
(optional) vets every dataset row before training (e.g. that each has a readable
reference answer) and raises naming the first bad one.

Without the registry: `Trainer(cfg, reward_fn=my_fn)` takes a callable, and
`reward.fn=package.module:function` imports one by name (YAML or command line).
`reward.kwargs.<key>=<value>` become keyword arguments of the function (e.g.
`reward.kwargs.mode=flexible` for `gsm8k`). Whichever way it comes, the function gets
the same checks: its signature is bound before the model loads, it is probed once on
placeholder completions, and a reward that raises or is NaN names the sample.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from hybrid_rl.runtime.user_import import import_object

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[dict]], Sequence[float]]
RowCheck = Callable[[Sequence[dict], str], None]  # (rows, source name) -> None, raises on a bad row


@dataclass(frozen=True)
class RewardSpec:
    fn: RewardFn
    success_threshold: float = 1.0  # a reward at or above this counts as correct (accuracy metric)
    check_rows: Optional[RowCheck] = None  # vets the dataset rows before training


_REGISTRY: dict[str, RewardSpec] = {}


def _register_builtin_rewards() -> None:
    """Import the built-in reward modules; their @register_reward decorators fill the registry."""
    # Inside a function, not at the top: toy imports this module for register_reward.
    import hybrid_rl.rewards.latex_math  # noqa: F401  (`math`: LaTeX answers through math-verify)
    import hybrid_rl.rewards.math  # noqa: F401  (imported for their side effect; Python imports each once)
    import hybrid_rl.rewards.toy  # noqa: F401


def register_reward(
    name: str, success_threshold: float = 1.0, check_rows: Optional[RowCheck] = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` as reward `name` (selected by `reward.name=name`)."""

    def deco(fn: RewardFn) -> RewardFn:
        old = _REGISTRY.get(name)
        # A notebook cell run again defines the same function anew: the new definition replaces it.
        redefined = old is not None and (
            getattr(old.fn, "__module__", None),
            getattr(old.fn, "__qualname__", None),
        ) == (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
        if old is not None and not redefined:
            where = f"{getattr(old.fn, '__module__', '?')}.{getattr(old.fn, '__qualname__', '?')}"
            raise ValueError(
                f"reward function {name!r} is already registered (by {where}); pick another name, "
                "or pass the function itself: Trainer(cfg, reward_fn=fn)"
            )
        _REGISTRY[name] = RewardSpec(fn, success_threshold, check_rows)
        return fn

    return deco


def get_reward(name: str) -> RewardSpec:
    """The registered reward `name`; the built-in rewards are registered here, on first use."""
    _register_builtin_rewards()
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown reward function {name!r} (config key 'reward.name'); registered: {sorted(_REGISTRY)}"
        )
    return _REGISTRY[name]


def load_reward_fn(path: str) -> RewardFn:
    """Import `package.module:function` (the form of `reward.fn`; runtime/user_import.py: beside the command too)."""
    return import_object(path, "reward.fn", "function")


def resolve_reward(
    name: str,
    fn_path: str = "",
    kwargs: Optional[Mapping[str, Any]] = None,
    success_threshold: Optional[float] = None,
    reward_fn: Optional[RewardFn] = None,
) -> tuple[str, RewardSpec]:
    """(display name, spec) of the run's reward: `reward_fn`, else `reward.fn`, else the registry's `name`.

    Keyword arguments are bound now and the call signature is checked, so a function that
    cannot take (prompts, completions, metadata, **kwargs) fails before any model loads.
    """
    if reward_fn is not None and fn_path:
        raise ValueError(
            f"config key 'reward.fn': set to {fn_path!r} and a reward_fn was passed to Trainer; give one of them"
        )
    if reward_fn is not None:
        shown, spec = getattr(reward_fn, "__qualname__", None) or repr(reward_fn), RewardSpec(reward_fn)
    elif fn_path:
        shown, spec = fn_path, RewardSpec(load_reward_fn(fn_path))
    else:
        shown, spec = name, get_reward(name)
    if not callable(spec.fn):
        raise ValueError(f"reward function {shown!r} is a {type(spec.fn).__name__}, not a callable")
    kwargs = dict(kwargs or {})
    try:
        signature = inspect.signature(spec.fn)
    except (TypeError, ValueError):  # some builtins and C callables have none to read
        signature = None
    if signature is not None:
        try:
            signature.bind([], [], [], **kwargs)
        except TypeError as err:
            extra = f" with keyword arguments {sorted(kwargs)} (config key 'reward.kwargs')" if kwargs else ""
            raise ValueError(
                f"reward function {shown!r} cannot be called as fn(prompts, completions, metadata)"
                f"{extra}: {err}; its signature is {shown}{signature}"
            ) from None
    if kwargs:
        spec = replace(spec, fn=functools.partial(spec.fn, **kwargs))
    if success_threshold is not None:
        spec = replace(spec, success_threshold=float(success_threshold))
    return shown, spec


def _first_failing(
    fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]
) -> Optional[int]:
    """The index of the first sample that makes `fn` raise on its own (None if none does alone)."""
    for i in range(len(completions)):
        try:
            fn([prompts[i]], [completions[i]], [metadata[i]])
        except Exception:  # noqa: BLE001 - looking for the culprit of an error already being reported
            return i
    return None


def _sample(i: int, prompts: Sequence[str], completions: Sequence[str]) -> str:
    return f"completion {i} ({completions[i][:120]!r}, of prompt {prompts[i][:80]!r})"


def compute_rewards(
    name: str, spec: RewardSpec, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]
) -> list[float]:
    """Call a reward function and check what it returns; never silently drops a sample."""
    try:
        out = spec.fn(prompts, completions, metadata)
    except Exception as err:
        i = _first_failing(spec.fn, prompts, completions, metadata)
        where = f" on {_sample(i, prompts, completions)}" if i is not None else ""
        raise RuntimeError(
            f"reward function {name!r} raised {type(err).__name__}: {err}{where}; fix the function "
            "(it must return one float per completion)"
        ) from err
    out = list(out)
    if len(out) != len(completions):
        raise ValueError(f"reward function {name!r} returned {len(out)} rewards for {len(completions)} completions")
    rewards = []
    for i, r in enumerate(out):
        value = _real(r)
        if value is None or not math.isfinite(value):
            raise ValueError(
                f"reward function {name!r} returned {r!r} for {_sample(i, prompts, completions)}; "
                "rewards must be finite real numbers (a Python, numpy or one-element torch number)"
            )
        rewards.append(value)
    return rewards


def _real(r) -> float | None:
    """r as a float when it is one real number: Python and numpy scalars, one-element arrays and tensors."""
    if isinstance(r, numbers.Real):
        return float(r)
    item = getattr(r, "item", None)
    if callable(item) and not isinstance(r, (str, bytes)):
        try:
            value = item()  # one-element numpy arrays and torch tensors; raises on more elements
        except (ValueError, RuntimeError, TypeError):
            return None
        return float(value) if isinstance(value, numbers.Real) else None
    return None
