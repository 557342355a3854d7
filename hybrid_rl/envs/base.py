"""The environment contract, its registry, and the checks that turn a broken environment into a named error.

An environment plays the other side of a multi-turn episode: `reset(row)` gives the opening
chat messages, and each `step(completion)` takes the model's latest turn as text and answers
with messages to append, a reward and whether the episode is over. The episode runner
(envs/episodes.py) owns the tokens; an environment only ever sees and returns text, so it
cannot cause re-tokenization or leak tokens into the loss.

Three ways to name one, like rewards (rewards/base.py): a factory passed in code, `env.fn =
package.module:factory`, or a registry name (`@register_env("name")`; the built-ins register
themselves when `get_env` first imports them). A factory is called ONCE PER EPISODE with the
dataset row, so per-episode state (a hidden answer, a tool-call counter) lives on the object it
returns, and episodes never share it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from hybrid_rl.runtime.user_import import import_object


@dataclass
class Step:
    observation: list[dict] = field(default_factory=list)  # messages to append (role "tool" or "user"); empty when done
    reward: float = 0.0  # added to the episode's return
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> list[dict]:
        """The opening chat messages for this dataset row."""
        ...

    def step(self, completion: str) -> Step:
        """The model's latest turn, as text -> a Step (or any object with observation, reward, done)."""
        ...


# Optional: an environment may also define `metrics() -> dict[str, float]`, counts the runner sums
# over episodes (tool calls, malformed calls, tool errors); the tool environment does.

EnvFactory = Callable[[dict], Any]  # row -> an object with reset and step


class EnvError(RuntimeError):
    """An environment broke its contract or raised; the message names the environment and the episode."""


@dataclass(frozen=True)
class EnvSpec:
    factory: EnvFactory  # row -> environment, called once per episode


_REGISTRY: dict[str, EnvSpec] = {}


def _register_builtin_envs() -> None:
    """Import the built-in environment modules; their @register_env decorators fill the registry."""
    import hybrid_rl.envs.gsm8k_calc  # noqa: F401  (imported for the side effect)
    import hybrid_rl.envs.tiny_ask  # noqa: F401


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: register `factory` as environment `name`; a taken name raises (a re-run cell replaces itself)."""

    def deco(factory: EnvFactory) -> EnvFactory:
        old = _REGISTRY.get(name)
        key = (getattr(factory, "__module__", None), getattr(factory, "__qualname__", None))
        if old is not None and key != (
            getattr(old.factory, "__module__", None),
            getattr(old.factory, "__qualname__", None),
        ):
            raise ValueError(
                f"environment {name!r} is already registered (by {_describe(old.factory)}); "
                "pick another name, or pass the factory itself"
            )
        _REGISTRY[name] = EnvSpec(factory)
        return factory

    return deco


def get_env(name: str) -> EnvSpec:
    """The registered environment `name`; the built-ins are registered here, on first use."""
    _register_builtin_envs()
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r} (config key 'env.name'); registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def load_env_factory(path: str) -> EnvFactory:
    """Import `package.module:factory` (the form of `env.fn`; runtime/user_import.py: beside the command too)."""
    obj = import_object(path, "env.fn", "factory")
    if not callable(obj):
        raise ValueError(f"config key 'env.fn': {path!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def resolve_env(name: str = "", fn_path: str = "", factory: Optional[EnvFactory] = None) -> tuple[str, EnvSpec]:
    """(display name, spec): a factory passed in code, else `env.fn`, else the registry's `env.name`."""
    given = [what for what, v in (("a factory", factory), ("env.fn", fn_path), ("env.name", name)) if v]
    if len(given) > 1:
        raise ValueError(f"an environment is named {len(given)} ways ({', '.join(given)}); give one of them")
    if factory is not None:
        return _describe(factory), EnvSpec(factory)
    if fn_path:
        return fn_path, EnvSpec(load_env_factory(fn_path))
    if name:
        return name, get_env(name)
    raise ValueError("no environment: set env.name (a registered one) or env.fn=package.module:factory")


def make_env(factory: EnvFactory, row: dict, env_name: str, episode: str) -> Any:
    """Call the factory for one episode and check that what it made can reset and step."""
    try:
        env = factory(row)
    except Exception as err:
        raise EnvError(
            f"environment {env_name!r}: factory {_describe(factory)} raised {type(err).__name__}: {err} for {episode}"
        ) from err
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise EnvError(
            f"environment {env_name!r}: factory {_describe(factory)} returned a {type(env).__name__} "
            f"without {' and '.join(missing)}() (for {episode}); it must return an object with "
            "reset(row) -> list[dict] and step(completion: str) -> Step"
        )
    return env


def check_messages(messages: Any, what: str, env_name: str, episode: str) -> list[dict]:
    """`messages` as a list of {"role": str, "content": str} dicts, or an EnvError saying which part is wrong."""
    if not isinstance(messages, (list, tuple)):
        raise EnvError(
            f"environment {env_name!r}: {what} must be a list of chat messages, got "
            f"{type(messages).__name__} {str(messages)[:80]!r} ({episode})"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise EnvError(
                f"environment {env_name!r}: {what}[{i}] must be a dict with string 'role' and 'content', "
                f"got {str(m)[:120]!r} ({episode})"
            )
    return list(messages)


def as_step(result: Any, env_name: str, episode: str) -> Step:
    """A step result as a `Step`: the library's own, or any object with observation, reward and done."""
    missing = [a for a in ("observation", "reward", "done") if not hasattr(result, a)]
    if missing:
        raise EnvError(
            f"environment {env_name!r}: step() returned a {type(result).__name__} without "
            f"{', '.join(missing)} ({episode}); return hybrid_rl.envs.Step(observation, reward, done)"
        )
    reward, done = result.reward, result.done
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvError(
            f"environment {env_name!r}: step() reward must be a finite real number, got {reward!r} ({episode})"
        )
    if not isinstance(done, (bool, numbers.Integral)):
        raise EnvError(f"environment {env_name!r}: step() done must be a bool, got {done!r} ({episode})")
    observation = check_messages(result.observation, "step().observation", env_name, episode)
    return Step(observation, float(reward), bool(done))


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
