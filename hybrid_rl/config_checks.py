"""How a config value is checked, and the checks that need the machine.

Every refusal is a `ValueError` reading `config key 'section.key': ...`, so a user knows
which YAML line or override to fix. A key whose value is one of a fixed set is annotated
`Literal[...]` in the schema (config.py) and `check_choices` reads the allowed values from
that annotation: adding a choice is editing the annotation, no check changes.
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Sequence, Union, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from hybrid_rl.config import AlgorithmConfig, Config


def check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key '{key}': {msg}")


def command_line(main: Callable[[list[str]], Any], argv: list[str]) -> int:
    """A recipe's `__main__`: `main(argv)`, where a refusal naming a config key (every config error reads
    `config key '...': ...`) prints that one line to stderr (rank 0 of a multi-rank run), not a traceback
    ending in it, and exits 2; any other error keeps its traceback. A notebook or a test calling `main`
    directly still gets the ValueError."""
    try:
        main(argv)
    except ValueError as err:
        if not str(err).startswith("config key '"):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def one_of(value: Any, key: str, choices: Sequence[Any]) -> None:
    check(value in choices, key, f"got {value!r}, expected one of {list(choices)}")


def literal_choices(annotation: Any) -> Optional[tuple]:
    """The values a `Literal[...]` annotation allows, or None for any other annotation."""
    return get_args(annotation) if get_origin(annotation) is Literal else None


@functools.lru_cache(maxsize=None)
def _choice_fields(cls: type) -> tuple[tuple[str, tuple, bool], ...]:
    """(field, allowed values, holds a list of them) for each `Literal` or `list[Literal]` field of `cls`."""
    out = []
    for name, annotation in get_type_hints(cls).items():
        is_list = get_origin(annotation) is list
        choices = literal_choices(get_args(annotation)[0] if is_list else annotation)
        if choices is not None:
            out.append((name, choices, is_list))
    return tuple(out)


def check_choices(obj: Any, section: str) -> None:
    """Refuse a `Literal` field of dataclass `obj` (each item of a `list[Literal]`) outside its annotation's values.

    The error names `section.field`, the value and the allowed values.
    """
    for name, choices, is_list in _choice_fields(type(obj)):
        value = getattr(obj, name)
        for item in value if is_list else [value]:
            one_of(item, f"{section}.{name}", choices)


def clip_bound(value: Any, key: str) -> Union[float, str, None]:
    """A number >= 0 (as float), null (no bound) or "auto" (the loss's default, see clip_bounds)."""
    if value is None or value == "auto":
        return value
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, key,
          f"got {value!r}; expected a number >= 0, null (no bound on that side) or 'auto' (the loss's default)")
    return float(value)


def check_preset_applied(algo: "AlgorithmConfig") -> None:
    """`AlgorithmConfig(preset="dapo")` records the name only: refuse it when none of the preset's own
    values (those that differ from the defaults) is set, instead of silently running the defaults."""
    if not algo.preset:
        return
    from hybrid_rl.algorithms.presets import preset_values

    defaults = {f.name: f.default for f in fields(algo)}
    distinctive = {k: v for k, v in preset_values(algo.preset).items() if v != defaults[k]}
    if distinctive and all(getattr(algo, k) == defaults[k] for k in distinctive):
        raise ValueError(
            f"config key 'algorithm.preset': {algo.preset!r} is named but none of its values "
            f"({', '.join(f'{k}={v!r}' for k, v in sorted(distinctive.items()))}) is set: the constructor "
            f"records the name only. Use AlgorithmConfig.from_preset({algo.preset!r}, ...) in Python, or "
            f"algorithm.preset={algo.preset} in a YAML or an override")


def _check_model_dir(path: str, key: str, what: str) -> None:
    check(os.path.isdir(path), key, f"directory {path!r} does not exist; give a local Hugging Face {what} directory")
    check(os.path.isfile(os.path.join(path, "config.json")), key,
          f"{path!r} has no config.json; is it a Hugging Face model directory?")


def validate_runtime(cfg: "Config", world_size: int) -> None:
    """Checks that need the machine (paths, ranks); raised before any model is built."""
    check(bool(cfg.model.path), "model.path", "is empty; point it at a local Hugging Face model directory")
    _check_model_dir(cfg.model.path, "model.path", "model")
    if cfg.reward.model_path:
        _check_model_dir(cfg.reward.model_path, "reward.model_path", "reward model")
    from hybrid_rl.models.lora import check_engine, check_model_dir

    # model.lora.*: the engine serves adapters, model.path is no adapter directory, every target matches a
    # Linear no narrower than the rank (the model built on the meta device from config.json: no weights read)
    check_engine(cfg.model.lora, cfg.rollout.engine)
    check_model_dir(cfg.model.lora, cfg.model.path)
    if cfg.rollout.engine in ("sglang", "vllm"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        check(local % cfg.rollout.tp_size == 0, "rollout.tp_size",
              f"{cfg.rollout.tp_size} does not divide the {local} ranks of this node")
    if cfg.trainer.placement == "split":  # refusals naming the key (split/placement.py); the learners train
        from hybrid_rl.split.placement import check_placement

        t, a = cfg.trainer, cfg.algorithm
        check_placement(world_size, t.rollout_ranks, t.max_staleness, t.stale_samples, tp_size=cfg.rollout.tp_size,
                        batch_size=cfg.data.batch_size, group_size=cfg.rollout.n, mini_batch_size=a.mini_batch_size,
                        rollout_correction=a.rollout_correction, engine=cfg.rollout.engine)
        world_size -= t.rollout_ranks
    b = cfg.data.batch_size
    check(b % world_size == 0, "data.batch_size",
          f"{b} prompts do not divide over {world_size} ranks; use a multiple of {world_size}")
    n_seq = b * cfg.rollout.n
    mb = cfg.algorithm.mini_batch_size or n_seq
    check(n_seq % mb == 0, "algorithm.mini_batch_size",
          f"{mb} does not divide the {n_seq} sequences of a step (data.batch_size x rollout.n)")
    check(mb % world_size == 0, "algorithm.mini_batch_size", f"{mb} sequences do not divide over {world_size} ranks")
    check(mb % cfg.rollout.n == 0, "algorithm.mini_batch_size",
          f"counts sequences, and {mb} is not a multiple of rollout.n={cfg.rollout.n}: a mini-batch would split a "
          f"prompt's group (verl's ppo_mini_batch_size counts prompts: multiply it by rollout.n)")
    buffer = cfg.algorithm.overlong_buffer_len
    check(buffer is None or buffer <= cfg.rollout.max_new_tokens, "algorithm.overlong_buffer_len",
          f"{buffer} is longer than rollout.max_new_tokens={cfg.rollout.max_new_tokens}; use at most that (or null)")
