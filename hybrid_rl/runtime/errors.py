"""The mark of an error a user fixes from its message alone (a refused resume, a full disk, a malformed override).

On the command line such an error is printed as its one line and the recipe exits with status 2
(config/checks.py `command_line`); from Python it raises as any exception does. Config errors need no mark:
every one of them reads `config key '...': ...`. Torch-free, so config/ may import it.
"""

from __future__ import annotations


class UserError(Exception):
    """Its message says what went wrong and what to do; no traceback would add to it."""
