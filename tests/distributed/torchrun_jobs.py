"""The tiny recipe under real `torchrun` launchers, one node or several on localhost, with
every process they start killed at the end whatever the test did.

    with torchrun_jobs.Job(tmp_path) as job:
        job.single_node(2, overrides)              # one launcher, two ranks
        job.multi_node(2, overrides)               # two launchers (node ranks 0, 1), one rank each
        job.wait_for_file(path, timeout_s)         # e.g. the fault file a rank writes
        rcs = job.wait(timeout_s)                  # each launcher's exit status, None if still running
        job.output(0)                              # launcher 0's stdout + stderr

Launchers get their own session and torchrun gives each worker another, so a kill of the
launcher's process group would miss the workers: the job remembers every descendant it has
seen (from /proc, while it waits) and kills those still alive, orphans included.
Multi-node runs use torchrun's default `static` rendezvous (`--node_rank`, `--master_addr`
and `--master_port`; node 0's launcher hosts the store), which works offline on localhost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

from hybrid_rl.runtime.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "grpo_tiny.py")
# A step of about a second on 2 CPU cores; progress bars never go to a log.
# A constant lr: test_multinode resumes with another total_steps, which the recipe's cosine decay refuses.
SMALL = [
    "data.batch_size=4",
    "rollout.n=2",
    "trainer.progress_bar=false",
    "trainer.device=cpu",
    "optim.lr_schedule=constant",
]


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children before grandchildren), from /proc."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except FileNotFoundError:
                continue
            out += kids
            todo += kids
    return out


class Job:
    def __init__(self, log_dir, env: Optional[dict] = None):
        self.log_dir = str(log_dir)
        # The repository root on the path: `reward.fn=tests.distributed.faulty_reward:...` imports from it.
        path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        self.procs: list[subprocess.Popen] = []
        self.seen: dict[int, str] = {}  # pid -> start time, so a reused pid is never killed

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def _launch(self, torchrun_args: list[str], argv: list[str]) -> None:
        i = len(self.procs)
        log = open(os.path.join(self.log_dir, f"launcher{i}.log"), "w")
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *argv]
        self.procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        log.close()

    def single_node(self, nproc: int, overrides: list[str], script: str = RECIPE) -> None:
        self._launch([f"--nproc_per_node={nproc}", f"--master_port={free_port()}"], [script, *overrides])

    def multi_node(self, nnodes: int, overrides: list[str], script: str = RECIPE, prefix: list[str] = ()) -> None:
        """`nnodes` launchers with node ranks 0.. on this machine, one process each (global rank = node rank)."""
        port = free_port()
        for node in range(nnodes):
            self._launch(
                [
                    f"--nnodes={nnodes}",
                    "--nproc_per_node=1",
                    f"--node_rank={node}",
                    "--master_addr=127.0.0.1",
                    f"--master_port={port}",
                ],
                [*prefix, script, *overrides],
            )

    def wait_for_file(self, path: str, timeout_s: float) -> float:
        """Monotonic time at which `path` was seen; fails if every launcher ended or time ran out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._remember()
            if os.path.exists(path):
                return time.monotonic()
            if all(p.poll() is not None for p in self.procs):
                raise AssertionError(f"every launcher ended before {path} appeared:\n{self.tails()}")
            time.sleep(0.05)
        raise AssertionError(f"{path} did not appear within {timeout_s} s:\n{self.tails()}")

    def wait(self, timeout_s: float, which: Optional[list[int]] = None) -> list[Optional[int]]:
        """Exit status of each launcher in `which` (default: all), None for one still running after `timeout_s`."""
        which = list(range(len(self.procs))) if which is None else which
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(self.procs[i].poll() is None for i in which):
            self._remember()
            time.sleep(0.05)
        return [self.procs[i].poll() for i in which]

    def output(self, i: int) -> str:
        with open(os.path.join(self.log_dir, f"launcher{i}.log"), errors="replace") as f:
            return f.read()

    def tails(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- launcher {i} (exit {p.poll()}):\n{self.output(i)[-chars:]}" for i, p in enumerate(self.procs)
        )

    def _remember(self) -> None:
        for p in self.procs:
            for pid in descendants(p.pid):
                self.seen.setdefault(pid, _start_time(pid))

    def kill(self) -> None:
        """SIGKILL every process this job started that is still alive (workers first)."""
        self._remember()
        for pid, started in reversed(list(self.seen.items())):
            if started and _start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (FileNotFoundError, IndexError):
        return ""
