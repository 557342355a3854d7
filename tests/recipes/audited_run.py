"""Run a script as __main__ and log every file this process writes under some directories.

    WRITE_AUDIT_DIRS=/run:/model WRITE_AUDIT_LOG=/logs/rank{rank}.tsv \\
        torchrun ... tests/recipes/audited_run.py recipes/grpo_tiny.py key=value ...

One line per write, "event<TAB>absolute path": files opened for writing, both ends of a
rename (an atomic directory swap shows as its destination), removals and rmtree. Directory
creation is left out (several ranks may `makedirs(exist_ok=True)` the same one harmlessly).
Writes from native code (safetensors) are not seen; the rename that publishes them is.
Python's audit hooks (PEP 578) report these events before they happen, in this process only.
"""

import os
import runpy
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PATH_ARGS = {
    "os.rename": (0, 1),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "shutil.rmtree": (0,),
    "os.truncate": (0,),
    "shutil.copyfile": (1,),
    "shutil.move": (0, 1),
    "os.link": (1,),
    "os.symlink": (1,),
}


def _install(log_path: str, roots: list[str]) -> None:
    log = open(log_path, "a", buffering=1)

    def watched(path) -> str:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, (str, os.PathLike)):
            return ""  # a file descriptor
        path = os.path.abspath(os.fspath(path))
        return path if any(path == r or path.startswith(r + os.sep) for r in roots) else ""

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            paths = [path] if (mode and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS else []
        elif event in _PATH_ARGS:
            paths = [args[i] for i in _PATH_ARGS[event]]
        else:
            return
        for p in paths:
            hit = watched(p)
            if hit:
                log.write(f"{event}\t{hit}\n")

    sys.addaudithook(hook)


if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    _install(
        os.environ["WRITE_AUDIT_LOG"].format(rank=rank),
        [os.path.abspath(d) for d in os.environ["WRITE_AUDIT_DIRS"].split(os.pathsep)],
    )
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
