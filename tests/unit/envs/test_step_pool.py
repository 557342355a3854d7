"""The environment step pool (envs/step_pool.py): steps run on host threads, each bounded by a timeout,
and no thread outlives its use.

Catches: workers that never exit (every EpisodeRunner leaked max_workers threads: a full test run held
hundreds), a timed-out step that stalls the others, and results returned out of order.
"""

from __future__ import annotations

import threading
import time

from hybrid_rl.envs.step_pool import TIMED_OUT, StepPool


def _workers() -> int:
    return sum(t.name == "hybrid_rl-env-step" and t.is_alive() for t in threading.enumerate())


def _wait_until(cond, limit_s: float = 20.0) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_results_in_order_and_idle_workers_exit():
    before = _workers()
    pool = StepPool(max_workers=4, idle_s=0.2)
    assert pool.run(lambda x: x * x, [(i,) for i in range(10)], timeout_s=5.0) == [i * i for i in range(10)]
    assert _workers() - before <= 4
    assert _wait_until(lambda: _workers() == before), "idle step threads must exit"
    # The pool still works after its workers left: the next run starts new ones.
    assert pool.run(lambda x: x + 1, [(1,), (2,)], timeout_s=5.0) == [2, 3]
    assert _wait_until(lambda: _workers() == before)


def test_a_stuck_step_times_out_and_the_rest_finish():
    release = threading.Event()
    pool = StepPool(max_workers=2, idle_s=0.2)

    def step(i):
        if i == 0:
            release.wait(30)
        return i

    out = pool.run(step, [(i,) for i in range(5)], timeout_s=0.3)
    release.set()
    assert out[0] is TIMED_OUT and out[1:] == [1, 2, 3, 4]


def test_exceptions_are_returned_in_their_slot():
    def step(i):
        if i == 1:
            raise ValueError("bad step")
        return i

    out = StepPool(max_workers=2, idle_s=0.2).run(step, [(0,), (1,), (2,)], timeout_s=5.0)
    assert out[0] == 0 and isinstance(out[1], ValueError) and out[2] == 2
