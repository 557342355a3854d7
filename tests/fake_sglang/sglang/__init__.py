"""CPU stand-in for the `sglang` 0.5.21 package (tests only; see tests/fake_sglang/README.md).

`Engine` is imported lazily, as in the real package, so that `import sglang` in a
scheduler process does not pull in the engine.
"""
__version__ = "0.5.21"


def __getattr__(name):
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
