"""Exceptions that exist only in the stand-in (real SGLang has none of these).

Each one replaces a real failure that cannot be reproduced safely or visibly in a
test process: a process-tree kill, or silently wrong output.
"""


class EngineCrashed(RuntimeError):
    """A scheduler handler raised. The real scheduler then SIGQUITs the process that
    built the Engine and its handler kills the whole process tree, the caller
    included (note 0.1). The stand-in kills its schedulers instead, marks the engine
    dead and raises this from the failing call and from every later call."""


class WeightsNotLoadedError(RuntimeError):
    """generate() found NaN parameters: weights were released (contents discarded)
    and not every parameter was sent again. The real engine decodes garbage without
    any error (sglang#15246); the stand-in refuses, naming the parameters."""


class RankMismatchError(RuntimeError):
    """The TP ranks produced different outputs because their weights differ. On a
    real TP engine each rank holds a shard of one model, so the output would be
    garbage; the stand-in refuses."""
