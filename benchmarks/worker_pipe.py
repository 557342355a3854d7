"""The side-by-side benchmarks' worker processes (grpo_step.py, partial_rollouts.py): each side of a comparison runs in
its own process, which the parent steps one step at a time ("go" on its stdin) so that load falls on both sides
alike; a worker answers on its real stdout with protocol lines (PROTO + JSON), everything else it prints going to
its log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROTO = "@@"


# ----------------------------------------------------------------------------- in the worker
def proto_out():
    """The real stdout for protocol lines; everything else printed goes to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def send(out, obj) -> None:
    out.write(PROTO + json.dumps(obj) + "\n")
    out.flush()


def wait_go() -> bool:
    return sys.stdin.readline().strip() == "go"


def worker_env(threads: int) -> dict:
    """A worker's environment: `threads` torch threads, the checkout importable, vLLM's log on stderr."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }


# ----------------------------------------------------------------------------- in the parent
class WorkerProcess:
    """One side's process: started with `cmd`, stepped with step(), its stderr in `log_path`."""

    def __init__(self, side: str, cmd: list[str], env: dict, log_path: str):
        self.side = side
        self.log = open(log_path, "w")
        self.t_spawn = time.perf_counter()
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1, env=env, cwd=ROOT
        )
        self.steps: list[dict] = []
        self.ready: dict = {}
        self.startup_s = float("nan")

    def wait_ready(self) -> None:
        self.ready = self._read()
        self.startup_s = time.perf_counter() - self.t_spawn

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                self.log.flush()
                tail = open(self.log.name).read()[-3000:]
                raise RuntimeError(f"{self.side} worker died (rc={self.p.poll()}); log tail:\n{tail}")
            if line.startswith(PROTO):
                return json.loads(line[len(PROTO) :])

    def step(self) -> dict:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        r = self._read()
        self.steps.append(r)
        return r

    def close(self) -> None:
        try:
            self.p.stdin.write("stop\n")
            self.p.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()
