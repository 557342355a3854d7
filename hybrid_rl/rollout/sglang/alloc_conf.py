"""The caching allocator's settings string, as torch reads it, and expandable segments in it.

Which variable torch reads (c10/core/AllocatorConfig.cpp, AcceleratorAllocatorConfig::instance,
torch 2.9 and later, 2.13 included): the FIRST of PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF
(deprecated, warns), PYTORCH_HIP_ALLOC_CONF that is set is parsed, and the others are ignored,
not merged. "Set" means present: c10::utils::get_env returns an empty string for a variable
set to "", so PYTORCH_ALLOC_CONF="" hides PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
The string is `key:value` items joined by commas (a value may be a bracketed list with commas
of its own); whitespace is dropped; a later item overrides an earlier one with the same key;
expandable_segments takes exactly True or False.

Two things in SGLang's path care, and both read the environment by name, not torch's result:
  * torch_memory_saver (in every scheduler) refuses to start when the text
    "expandable_segments:True" occurs in PYTORCH_CUDA_ALLOC_CONF (entrypoint._sanity_checks),
    and does not look at PYTORCH_ALLOC_CONF, where the setting would silently defeat it;
  * CUDA IPC cannot export memory of expandable segments (pytorch#130330), so the trainer's
    own allocator must not use them while a bucket is exported.
So the engine's environment loses the item under every name, and the trainer's allocator is
switched with its whole settings string (a settings call resets every key it does not name).
Pure functions, plus `current_settings` and `apply_settings`, the calls into torch.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

# torch's order of precedence.
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_KEY = "expandable_segments"


def effective_conf(env: Mapping[str, str]) -> tuple[Optional[str], str]:
    """(the variable torch reads, its value), or (None, "") when none is set."""
    for name in ALLOC_CONF_NAMES:
        if name in env:
            return name, env[name]
    return None, ""


def _items(conf: str) -> list[str]:
    """`key:value` items of a settings string, whitespace dropped, brackets kept whole."""
    items, depth, current = [], 0, []
    for ch in "".join(conf.split()):
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
            continue
        depth += (ch == "[") - (ch == "]")
        current.append(ch)
    items.append("".join(current))
    return [item for item in items if item]


def expandable_segments(conf: str) -> bool:
    """Whether this settings string turns expandable segments on (the last item for the key wins)."""
    value = None
    for item in _items(conf):
        key, _, val = item.partition(":")
        if key == _KEY:
            value = val
    return value == "True"


def without_expandable(conf: str) -> str:
    """The settings string minus every expandable_segments item (the allocator's default is off)."""
    return ",".join(item for item in _items(conf) if item.partition(":")[0] != _KEY)


def with_expandable(conf: str, on: bool) -> str:
    """The settings string with expandable segments set to `on` and every other item kept."""
    return ",".join([*_items(without_expandable(conf)), f"{_KEY}:{on}"])


def ipc_safe(settings: str) -> Optional[str]:
    """The settings to export CUDA IPC handles under: `settings` with expandable segments off,
    or None when they are off already (nothing to switch, nothing to restore)."""
    return with_expandable(settings, False) if expandable_segments(settings) else None


def engine_env_updates(env: Mapping[str, str]) -> dict[str, str]:
    """New values for the variables an SGLang engine inherits: each set one without
    expandable_segments. A variable that is set stays set (even if empty), so the same
    name keeps winning in the engine's processes as in this one."""
    return {
        name: without_expandable(env[name])
        for name in ALLOC_CONF_NAMES
        if name in env and without_expandable(env[name]) != env[name]
    }


def current_settings() -> str:
    """The settings string the allocator last parsed: the winning variable at start-up, or the
    last settings call (torch 2.13 keeps it); the winning variable where torch cannot say."""
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter is not None else effective_conf(os.environ)[1]


def apply_settings(conf: str) -> None:
    """Re-parse the caching allocator's settings from `conf` (torch 2.13's name; the older one before)."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch 2.11 and older
        setter = torch.cuda.memory._set_allocator_settings
    setter(conf)
