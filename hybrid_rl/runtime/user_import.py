"""Importing what a user names in the config as `package.module:attr` (`reward.fn`, `env.fn`).

A module beside the user's command imports without PYTHONPATH: when its top-level package is on no
sys.path entry, the working directory and the running script's directory are tried (appended to
sys.path, so they never shadow an installed module). Errors name the config key and what failed.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from typing import Any


def user_dirs() -> list[str]:
    """Where a user's module lives beside their command: the working directory and the running script's
    directory (`python recipes/x.py` puts only recipes/ on sys.path, not the directory it ran from)."""
    dirs = [os.getcwd()]
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if script.endswith(".py") and os.path.isfile(script):
        dirs.append(os.path.dirname(os.path.abspath(script)))
    return list(dict.fromkeys(dirs))


def import_user_module(name: str):
    """importlib.import_module, and when the top-level package is on no sys.path entry, again with the first of
    `user_dirs` that has it appended to sys.path."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        top = name.split(".")[0]
        if err.name != top:
            raise
        for d in user_dirs():
            if d not in sys.path and importlib.machinery.PathFinder.find_spec(top, [d]) is not None:
                sys.path.append(d)
                return importlib.import_module(name)
        raise


def import_object(path: str, key: str, what: str) -> Any:
    """The object `package.module:attr.sub` names; `key` is the config key and `what` the kind of object
    ("function", "factory"), both for the errors."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"config key '{key}': {path!r} is not of the form package.module:{what}")
    try:
        obj = import_user_module(module_name)
    except Exception as err:  # an ImportError, or whatever the module raised while importing
        where = ", ".join(user_dirs())
        raise ValueError(
            f"config key '{key}': cannot import module {module_name!r} "
            f"({type(err).__name__}: {err}); looked on sys.path and in {where}: put the module in "
            f"one of those, or add its directory to PYTHONPATH (PYTHONPATH=/its/dir python ...)"
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"config key '{key}': module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
