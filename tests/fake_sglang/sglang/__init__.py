"""CPU stand-in for the `sglang` 0.5.21 package (tests only; see tests/fake_sglang/README.md).

`Engine` is imported lazily, as in the real package, so that `import sglang` in a
scheduler process does not pull in the engine. FAKE_SGLANG_VERSION=0.5.17, read when
`sglang.Engine` or `sglang.__version__` is looked up, gives 0.5.17's engine instead: the
one the lent GPU machines can run (note section 8), which has no weight-update session.
"""
import os

VERSIONS = ("0.5.21", "0.5.17")


def _version() -> str:
    v = os.environ.get("FAKE_SGLANG_VERSION", VERSIONS[0])
    if v not in VERSIONS:
        raise ValueError(f"FAKE_SGLANG_VERSION={v!r}: the stand-in models {VERSIONS}")
    return v


def __getattr__(name):
    if name == "__version__":
        return _version()
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine, Engine0517

        return Engine0517 if _version() == "0.5.17" else Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
