"""The Engine's side of the scheduler processes: start, call, crash, stop.

Real SGLang talks to its schedulers over ZMQ with a TokenizerManager in the caller's
process; the stand-in uses one multiprocessing Pipe per TP rank. Processes are started
with the global multiprocessing context after the Engine forced "spawn", and are not
daemonic, so building an Engine inside a daemonic process fails the way it does for
the real one ("daemonic processes are not allowed to have children"). A streamed
generate (scheduler.py `_Stream`) keeps rank 0 sending after the call: `read_stream`
takes its messages, and a call made before the stream was drained skips what is left
of it.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Dict, List, Optional

from sglang.fake_errors import EngineCrashed, WeightsNotLoadedError
from sglang.srt.managers.scheduler import run_scheduler_process

_STREAM_MESSAGES = ("stream_start", "chunk", "stream_end")
START_TIMEOUT_S = 600.0  # loading transformers in a fresh process is slow on a busy machine
CALL_TIMEOUT_S = 600.0


class SchedulerClient:
    def __init__(self, tp_size: int, args: Dict[str, Any]):
        self.procs: List[mp.Process] = []
        self.conns = []
        self.dead_reason: Optional[str] = None
        self.closed = False
        self.stream_open = False  # rank 0 is streaming a generate (between start_stream and its "stream_end")
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
        self._send_all(cmd, arg, per_rank)
        return self._collect(range(len(self.conns)), CALL_TIMEOUT_S, cmd)

    def _send_all(self, cmd: str, arg: Any, per_rank: Optional[list] = None) -> None:
        self.check_alive()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((cmd, per_rank[rank] if per_rank is not None else arg))
            except (BrokenPipeError, OSError) as err:
                self.crash(f"scheduler TP rank {rank} is gone ({err!r}) while sending {cmd!r}")

    def send_nowait(self, rank: int, cmd: str, arg: Any = None) -> None:
        """A message no reply follows (an AbortReq): rank reads it between decode steps, or when idle."""
        self.check_alive()
        try:
            self.conns[rank].send((cmd, arg))
        except (BrokenPipeError, OSError) as err:
            self.crash(f"scheduler TP rank {rank} is gone ({err!r}) while sending {cmd!r}")

    # -- a streamed generate (scheduler.py `_Stream`) ----------------------------
    def start_stream(self, cmd: str, arg: Any) -> tuple:
        """Send `cmd` to every rank: (rank 0's weights digest, the other ranks' replies). Rank 0 then streams."""
        self._send_all(cmd, arg)
        self.stream_open = True
        others = self._collect(range(1, len(self.conns)), CALL_TIMEOUT_S, cmd)
        status, digest = self.read_stream(cmd)
        assert status == "stream_start", status
        return digest, others

    def read_stream(self, what: str) -> tuple:
        """Rank 0's next message of the stream: ("stream_start", digest), ("chunk", ...) or ("stream_end", None)."""
        status, value = self._next(0, CALL_TIMEOUT_S, what)
        if status == "stream_end":
            self.stream_open = False
        return status, value

    def _next(self, rank: int, timeout: float, what: str) -> tuple:
        conn, proc = self.conns[rank], self.procs[rank]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if not proc.is_alive() and not conn.poll(0):
                self.crash(f"scheduler TP rank {rank} died (exit code {proc.exitcode}) during {what!r}")
            if time.monotonic() > deadline:
                self.crash(f"scheduler TP rank {rank} did not answer {what!r} within {timeout:.0f} s")
        try:
            status, value = conn.recv()
        except (EOFError, OSError) as err:
            self.crash(f"scheduler TP rank {rank} closed its pipe during {what!r} ({err!r})")
        if status == "crash":
            self.crash(value)
        if status == "error":
            raise WeightsNotLoadedError(value)
        return status, value

    def _collect(self, ranks, timeout: float, what: str) -> list:
        replies, errors, crashes = {}, [], []
        deadline = time.monotonic() + timeout
        for rank in ranks:
            conn, proc = self.conns[rank], self.procs[rank]
            while True:
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
                        break
                    if status in _STREAM_MESSAGES:  # a streamed generate nobody drained: its rest is dropped
                        self.stream_open = self.stream_open and status != "stream_end"
                        continue
                    if status == "crash":
                        crashes.append(value)
                    elif status == "error":
                        errors.append(value)
                    else:
                        replies[rank] = value
                break
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
