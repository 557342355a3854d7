"""How a config value is checked: the helpers the schema's `__post_init__` checks call.

Every refusal is a `ValueError` reading `config key 'section.key': ...`, so a user knows
which YAML line or override to fix. A key whose value is one of a fixed set is annotated
`Literal[...]` in the schema (config/schema.py) and `check_choices` reads the allowed values from
that annotation: adding a choice is editing the annotation, no check changes.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Literal, Optional, Sequence, Union, get_args, get_origin, get_type_hints


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
    check(
        isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
        key,
        f"got {value!r}; expected a number >= 0, null (no bound on that side) or 'auto' (the loss's default)",
    )
    return float(value)
