"""How a config value is checked: the helpers the schema's `__post_init__` checks call.

Every refusal is a `ValueError` reading `config key 'section.key': ...`, so a user knows
which YAML line or override to fix. A key whose value is one of a fixed set is annotated
`Literal[...]` in the schema (config/schema.py) and `check_choices` reads the allowed values from
that annotation: adding a choice is editing the annotation, no check changes. A field set from Python
is checked by name and type where it is set (`strict_sections`), in the words the command line uses.

Also here, the recipes' command line: `command_line` (a user's mistake as its one line, exit status 2)
and `RecipeParser` (the flags, `--help`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import numbers
import os
import sys
from typing import Any, Callable, Literal, NoReturn, Optional, Sequence, Union, get_args, get_origin, get_type_hints

from hybrid_rl.runtime.errors import UserError


def check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key '{key}': {msg}")


def command_line(main: Callable[[list[str]], Any], argv: list[str]) -> int:
    """A recipe's `__main__`: `main(argv)`, where a user's mistake is printed as its one line to stderr (rank 0 of a
    multi-rank run), not a traceback ending in it, and the exit status is 2: a refusal naming a config key (every
    config error reads `config key '...': ...`) or any `UserError` (a refused or damaged checkpoint, a full disk,
    an override without '='). A run stopped by a signal (`TrainingInterrupted`, already announced by `fit`) exits
    with its own status, 128 + the signal. Any other error keeps its traceback. A notebook or a test calling
    `main` directly still gets the exception."""
    try:
        main(argv)
    except Exception as err:
        if not (isinstance(err, UserError) or str(err).startswith("config key '")):
            raise
        if not getattr(err, "announced", False) and os.environ.get("RANK", "0") == "0":  # one line, once
            print(f"error: {err}", file=sys.stderr, flush=True)
        return getattr(err, "exit_status", 2)
    return 0


OVERRIDES_HELP = """\
config keys:
  Set any config key after the flags as key.sub=value (an OmegaConf dot-list, no spaces around '='):
    trainer.total_steps=100 optim.lr=5e-4 trainer.loggers=[console,wandb] trainer.resume=none
  Defaults: {yaml}
  Every key: docs/configuration.md and hybrid_rl/config/schema.py (each key with its comment);
  metrics: docs/metrics.md; checkpoints and resume: docs/checkpoints.md"""


class RecipeParser(argparse.ArgumentParser):
    """A recipe's flags. `--help` prints the recipe's purpose (its docstring), its flags, how `key.sub=value`
    overrides are passed and where the keys are documented; a bad flag is one line and exit status 2 (argparse
    itself prints the usage before it)."""

    def __init__(self, doc: str, yaml: str):
        super().__init__(
            description=doc.strip(),
            epilog=OVERRIDES_HELP.format(yaml=yaml),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            usage="%(prog)s [flags] [key.sub=value ...]",
        )

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def parse(self, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
        """(the flags, the key=value overrides); an unknown flag is refused, not taken for an override."""
        args, rest = self.parse_known_args(list(argv))
        flags = [a for a in rest if a.startswith("-")]
        if flags:
            self.error(f"unrecognized flag {flags[0]!r}")
        return args, rest


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


# -- fields set from Python ---------------------------------------------------
class UnknownKeyError(ValueError, AttributeError):
    """A name that is not a config field, set from Python: a ValueError like every config error, and an
    AttributeError as Python reports a missing attribute (so `hasattr`-style probes still read it as one)."""


def strict_sections(root: type, prefix: str = "") -> None:
    """Make dataclass `root` and every dataclass section under it refuse, when a field is set from Python
    (`cfg.trainer.save_evry = 1`, `cfg.optim.lr = "fast"`, a constructor's keyword included), a name that is
    not a field and a value of the wrong type, in the words `load_config` uses for the same mistake on the
    command line. A silently accepted typo runs a different experiment than the one written. Values (ranges,
    choices across keys) are still checked by `__post_init__` when the Trainer is built: a change may need a
    second one before the pair is valid again."""
    hints = get_type_hints(root)
    for name, annotation in hints.items():
        if dataclasses.is_dataclass(annotation):
            strict_sections(annotation, f"{prefix}{name}.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in hints:
            raise UnknownKeyError(f"config key '{prefix}{name}': {unknown_key(name, type(self).__name__, hints)}")
        object.__setattr__(self, name, typed(value, hints[name], prefix + name))

    root.__setattr__ = __setattr__


def unknown_key(name: str, cls_name: str, fields: Sequence[str]) -> str:
    """OmegaConf's words for a key the schema lacks (a typo on the command line reads the same)."""
    close = difflib.get_close_matches(name, list(fields), n=3, cutoff=0.6)
    hint = ""
    if len(close) == 1:
        hint = f". Did you mean: {close[0]!r}?"
    elif close:
        hint = f". Did you mean one of: {', '.join(repr(k) for k in close)}?"
    return f"Key {name!r} not in {cls_name!r}{hint}"


_NAMES = {int: "Integer", float: "Float", str: "String"}


def typed(value: Any, annotation: Any, key: str) -> Any:
    """`value` as the field annotated `annotation` holds it, or a ValueError naming `key`. Only widenings that
    lose nothing are made (an int for a float, a path object for a string); anything else is refused as the
    command line refuses a value it cannot convert."""
    if annotation is Any:
        return value
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for member in (a for a in args if a is not type(None)):
            try:
                return typed(value, member, key)
            except ValueError as err:
                errors.append(err)
        if len(errors) == 1:
            raise errors[0]
        hint = str(annotation).replace("typing.", "")
        raise ValueError(
            f"config key '{key}': Value '{value}' of type {type(value).__name__!r} is incompatible with type hint "
            f"{hint!r}"
        )
    if origin is Literal:
        check(value in args, key, f"got {value!r}, expected one of {list(args)}")
        return value
    if origin is list:
        check(
            isinstance(value, (list, tuple)),
            key,
            f"Value '{value}' of type {type(value).__name__!r} is not a list; a list is written in brackets: "
            f"[{value!r}] (or [] for none)",
        )
        # A choice is named by its list, as on the command line (trainer.loggers, not trainer.loggers[1]).
        by_list = get_origin(args[0]) is Literal
        return [typed(v, args[0], key if by_list else f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        check(isinstance(value, dict), key, f"Value '{value}' of type {type(value).__name__!r} is not a dict")
        return {typed(k, args[0], key): typed(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(annotation):
        check(
            isinstance(value, annotation),
            key,
            f"Value '{value}' of type {type(value).__name__!r} is not a {annotation.__name__}; set its fields "
            f"instead ({key}.<field> = ...)",
        )
        return value
    if annotation is bool:
        check(isinstance(value, bool), key, f"Value '{value}' is not a valid bool (type {type(value).__name__})")
        return value
    if annotation is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if annotation is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if annotation is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    raise ValueError(
        f"config key '{key}': Value '{value}' of type {type(value).__name__!r} could not be converted to "
        f"{_NAMES.get(annotation, getattr(annotation, '__name__', annotation))}"
    )
