"""Loading a config: the schema (config/schema.py) <- a YAML file <- `key.sub=value` overrides.

OmegaConf is used only here, to merge those layers onto the dataclasses and to write the
resolved config back as YAML. Unknown keys and mistyped values fail in OmegaConf; its errors
are turned into the schema's own `config key '...': ...` form.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional, Sequence, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybrid_rl.config.checks import literal_choices
from hybrid_rl.config.schema import Config
from hybrid_rl.runtime.errors import UserError


class OverrideError(UserError, ValueError):
    """A command-line argument that is not `key.sub=value`."""


def _annotation_at(key: str) -> Any:
    """The schema's annotation of a dotted key; `a.b[1]` is an item of the list `a.b`. None if not a field."""
    tp: Any = Config
    for part in key.split("."):
        name, index = re.fullmatch(r"([^\[]*)((?:\[\d+\])?)", part).groups()
        if not dataclasses.is_dataclass(tp) or name not in get_type_hints(tp):
            return None
        tp = get_type_hints(tp)[name]
        if index:
            if get_origin(tp) is not list:
                return None
            tp = get_args(tp)[0]
    return tp


def _schema_error(err: OmegaConfBaseException) -> ValueError:
    key = getattr(err, "full_key", None) or ""
    # OmegaConf checks a `Literal` key's value while merging, before __post_init__: say it as check_choices does,
    # under the field's name (a list item's error names the list: trainer.loggers, not trainer.loggers[1]).
    choices = literal_choices(_annotation_at(key))
    value = getattr(err, "value", None)
    if choices is not None and value is not None and value not in choices:
        field_key = re.sub(r"\[\d+\]$", "", key)
        return ValueError(f"config key '{field_key}': got {value!r}, expected one of {list(choices)}")
    # The first line: OmegaConf's own detail lines (full_key, reference_type, object_type) repeat the key.
    msg = str(err.msg if hasattr(err, "msg") else err).strip().splitlines()[0]
    if "is not a ListConfig" in msg:
        msg += f"; a list is written in brackets: {key}=[a,b] (or {key}=[] for none)"
    elif msg.startswith("Incompatible value 'None'"):
        msg += f"; `{key}=` with nothing after it is null: give a value"
    return ValueError(f"config key '{key}': {msg}")


# verl's names for keys this schema spells otherwise, accepted in a YAML or an override (issue 36 names
# `algorithm.adv_estimator=gae`); the schema's name is what the saved config and the checkpoint hold.
VERL_NAMES = {"algorithm.adv_estimator": "algorithm.advantage"}


def _verl_names(layer: Any) -> Any:
    """The layer with verl's key names renamed to the schema's; both names with different values are refused."""
    for verl, ours in VERL_NAMES.items():
        section, key = verl.split(".")
        sub = layer.get(section) if hasattr(layer, "get") else None
        if sub is None or key not in sub:
            continue
        value = sub.pop(key)
        mine = ours.split(".")[1]
        if mine in sub and sub[mine] != value:
            raise ValueError(
                f"config key '{verl}': verl's name for '{ours}', given as {value!r} beside {ours}={sub[mine]!r}; "
                f"keep one of them"
            )
        sub[mine] = value
    return layer


def _with_preset(layer: Any) -> list:
    """A layer that names `algorithm.preset` gets the preset's keys right below it.

    So the preset beats the layers before it (the schema, a YAML under a command-line
    preset) and every key written in the same layer or a later one beats the preset.
    """
    name = OmegaConf.select(layer, "algorithm.preset", default=None)
    if not name:
        return [layer]
    from hybrid_rl.algorithms.presets import preset_values

    try:
        values = preset_values(name)
    except (ValueError, TypeError) as err:
        raise ValueError(f"config key 'algorithm.preset': {err}") from None
    return [OmegaConf.create({"algorithm": values}), layer]


def load_config(
    yaml_path: Optional[str] = None, overrides: Sequence[str] = (), base: Optional[Config] = None
) -> Config:
    """Build a validated `Config` from (base dataclass) <- YAML <- `key.sub=value` overrides.

    `algorithm.preset=NAME` in the YAML or the overrides expands, in that layer, to the
    preset's algorithm keys (hybrid_rl/algorithms/presets.py); explicit keys in the same or a
    later layer override them. A `base` config counts as already resolved: its preset is
    not expanded again.
    """
    if isinstance(overrides, str):
        raise TypeError(
            f"load_config: overrides is a list of 'key.sub=value' strings; got the string {overrides!r}: "
            f"pass [{overrides!r}]"
        )
    try:
        schema = OmegaConf.structured(base if base is not None else Config)
        layers = [schema]
        if yaml_path:
            if not os.path.isfile(yaml_path):
                raise FileNotFoundError(f"config file {yaml_path!r} does not exist")
            layers += _with_preset(_verl_names(OmegaConf.load(yaml_path)))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise OverrideError(
                f"command-line override {bad[0]!r} is not of the form key.sub=value (no spaces around '='; "
                f"a flag of the recipe starts with --, see --help)"
            )
        layers += _with_preset(_verl_names(OmegaConf.from_dotlist(list(overrides))))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)  # runs every __post_init__
    except OmegaConfBaseException as err:
        if not getattr(err, "full_key", None):  # a merge error names no key (`model.lora=3`): find the override
            err = _failing_override(overrides) or err
        raise _schema_error(err) from None


def _failing_override(overrides: Sequence[str]) -> Optional[OmegaConfBaseException]:
    """The error of the first override that fails alone, tagged with its key (OmegaConf's merge errors of a whole
    section carry none), or None."""
    for o in overrides:
        try:
            OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist([o]))
        except OmegaConfBaseException as err:
            err.full_key = err.full_key or o.split("=", 1)[0]
            err.msg = err.msg or str(err).splitlines()[0]
            return err
    return None


def save_config(cfg: Config, path: str, comment: str = "") -> None:
    """Write the resolved config as YAML (the run directory's record of what ran), `comment` as its first lines."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(f"# {line}\n" for line in comment.splitlines()))
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
