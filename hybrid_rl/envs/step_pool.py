"""Environment steps on host threads, each bounded by a timeout, so one slow environment never stalls the rest.

`concurrent.futures.ThreadPoolExecutor` would do most of this, but a step that never returns
would keep one of its workers forever and its (non-daemon) threads hold up interpreter exit.
Here the workers are daemon threads; a worker stuck past the timeout is written off and a
fresh one takes its place, so capacity stays and the run always moves on. The timeout counts
from when a step STARTS (a step waiting for a free worker is not late).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Sequence


class StepTimeout:
    """The result slot of a step that ran past the timeout (its thread is abandoned, still running)."""

    def __repr__(self) -> str:
        return "StepTimeout()"


TIMED_OUT = StepTimeout()


class StepPool:
    def __init__(self, max_workers: int = 16, idle_s: float = 10.0):
        """idle_s: a worker with nothing to do for that long exits (the next run() starts new ones), so a
        finished run, or a Trainer a notebook dropped, leaves no threads behind."""
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers, self.idle_s = max_workers, idle_s
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = 0
        self._lock = threading.Lock()

    def _spawn(self) -> None:
        with self._lock:
            self._workers += 1
        threading.Thread(target=self._work, daemon=True, name="hybrid_rl-env-step").start()

    def _work(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:  # no step waits (run() queues its steps before it counts workers): leave
                    if self._tasks.empty():
                        self._workers -= 1
                        return
                continue
            fut, started, fn, args = task
            if not fut.set_running_or_notify_cancel():
                continue
            started[0] = time.monotonic()
            try:
                fut.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the caller, who names the episode
                fut.set_exception(err)

    def run(self, fn: Callable, calls: Sequence[tuple], timeout_s: float) -> list[Any]:
        """fn(*args) for each args in `calls`; each slot holds the result, the exception raised, or TIMED_OUT."""
        futs, starts = [], []
        for args in calls:
            fut, started = Future(), [None]
            self._tasks.put((fut, started, fn, args))
            futs.append(fut)
            starts.append(started)
        with self._lock:
            missing = min(self.max_workers, len(calls)) - self._workers
        for _ in range(missing):
            self._spawn()
        out: list[Any] = [None] * len(calls)
        pending = set(range(len(calls)))
        while pending:
            now = time.monotonic()
            for i in list(pending):
                if futs[i].done():
                    err = futs[i].exception()
                    out[i] = err if err is not None else futs[i].result()
                    pending.discard(i)
                elif starts[i][0] is not None and now - starts[i][0] > timeout_s:
                    out[i] = TIMED_OUT
                    pending.discard(i)
                    self._replace_stuck_worker()
            if pending:
                running = [starts[i][0] for i in pending if starts[i][0] is not None]
                next_deadline = min(running) + timeout_s - now if running else 0.05
                wait(
                    [futs[i] for i in pending],
                    timeout=max(0.001, min(next_deadline, 0.05)),
                    return_when=FIRST_COMPLETED,
                )
        return out

    def _replace_stuck_worker(self) -> None:
        """The stuck thread keeps its slot until it returns; a new one serves the queue meanwhile."""
        with self._lock:
            self._workers -= 1
        self._spawn()
