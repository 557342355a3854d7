"""The Engine's side of the scheduler processes: start, call, crash, stop.

Real SGLang talks to its schedulers over ZMQ with a TokenizerManager in the caller's
process; the stand-in uses one multiprocessing Pipe per TP rank. Processes are started
with the global multiprocessing context after the Engine forced "spawn", and are not
daemonic, so building an Engine inside a daemonic process fails the way it does for
the real one ("daemonic processes are not allowed to have children").
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Dict, List, Optional

from sglang.fake_errors import EngineCrashed, WeightsNotLoadedError
from sglang.srt.managers.scheduler import run_scheduler_process

START_TIMEOUT_S = 600.0  # loading transformers in a fresh process is slow on a busy machine
CALL_TIMEOUT_S = 600.0


class SchedulerClient:
    def __init__(self, tp_size: int, args: Dict[str, Any]):
        self.procs: List[mp.Process] = []
        self.conns = []
        self.dead_reason: Optional[str] = None
        self.closed = False
        for rank in range(tp_size):
            parent_end, child_end = mp.Pipe()
            proc = mp.Process(target=run_scheduler_process, args=(rank, args, child_end),
                              name=f"sglang-fake-scheduler-TP{rank}", daemon=False)
            proc.start()
            child_end.close()  # so the parent sees EOF when the child dies
            self.procs.append(proc)
            self.conns.append(parent_end)
        self.pids = self._collect(range(tp_size), START_TIMEOUT_S, "start")

    # -- calls ----------------------------------------------------------------
    def call(self, cmd: str, arg: Any = None, per_rank: Optional[list] = None) -> list:
        """Send `cmd` to every rank (rank r gets per_rank[r] if given), return the replies in rank order."""
        self.check_alive()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((cmd, per_rank[rank] if per_rank is not None else arg))
            except (BrokenPipeError, OSError) as err:
                self.crash(f"scheduler TP rank {rank} is gone ({err!r}) while sending {cmd!r}")
        return self._collect(range(len(self.conns)), CALL_TIMEOUT_S, cmd)

    def _collect(self, ranks, timeout: float, what: str) -> list:
        replies, errors, crashes = {}, [], []
        deadline = time.monotonic() + timeout
        for rank in ranks:
            conn, proc = self.conns[rank], self.procs[rank]
            while not conn.poll(0.2):
                if not proc.is_alive() and not conn.poll(0):
                    crashes.append(f"scheduler TP rank {rank} died (exit code {proc.exitcode}) during {what!r}")
                    break
                if time.monotonic() > deadline:
                    crashes.append(f"scheduler TP rank {rank} did not answer {what!r} within {timeout:.0f} s")
                    break
            else:
                try:
                    status, value = conn.recv()
                except (EOFError, OSError) as err:
                    crashes.append(f"scheduler TP rank {rank} closed its pipe during {what!r} ({err!r})")
                    continue
                if status == "crash":
                    crashes.append(value)
                elif status == "error":
                    errors.append(value)
                else:
                    replies[rank] = value
        if crashes:
            self.crash("\n".join(crashes))
        if errors:
            raise WeightsNotLoadedError(errors[0])
        return [replies[r] for r in ranks]

    # -- failure and shutdown --------------------------------------------------
    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineCrashed("the engine crashed earlier and is dead (in real SGLang the caller's process "
                                f"would have been killed). First failure:\n{self.dead_reason}")
        if self.closed:
            raise RuntimeError("the Engine was shut down; build a new one")

    def crash(self, reason: str) -> None:
        """Mark the engine dead, kill the schedulers, raise EngineCrashed."""
        self.dead_reason = reason
        self._stop(graceful=False)
        raise EngineCrashed(
            "an SGLang scheduler raised; the real engine would now SIGQUIT the caller and kill its whole "
            f"process tree (note 0.1).\n{reason}")

    def shutdown(self) -> None:
        if self.closed:
            return
        self._stop(graceful=self.dead_reason is None)

    def _stop(self, graceful: bool) -> None:
        self.closed = True
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(("shutdown", None))
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=10 if graceful else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
