"""No hangs: when one rank of the tiny recipe dies, raises or hangs, the whole job ends, non-zero,
within a bound, and the output names that rank.

The fault is injected on rank 1 at step 2 through `reward.fn` (tests/distributed/faulty_reward.py),
inside the ROLLOUT phase, while rank 0 goes on into the step's first collective and waits there.
A dead peer fails that collective at once ("Connection closed by peer"), so a killed or raising
rank ends the job in seconds, far inside `trainer.dist_timeout_s`; a frozen peer (its sockets
still open) is only noticed by the process-group timeout, so that test sets it short. The
bounds are hang detectors, not speed targets: each is well above what the run needs and well
below what a hang costs.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.distributed.torchrun_jobs import SMALL, Job

pytestmark = pytest.mark.slow

START_S = 120  # start-up and the first step: imports and model building on 2 busy cores
LONG_TIMEOUT_S = 60  # the process-group timeout where a dead peer must be noticed without it
NOTICED_S = 25  # a dead or raising rank ends the job this soon after the fault (measured: ~1-3 s)
SHORT_TIMEOUT_S = 10  # the process-group timeout where a frozen peer is waited out
MARGIN_S = 20  # after that timeout: the error, the store exchange, the launcher's teardown


def _overrides(tmp_path, model_dir: str, how: str, timeout_s: int) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"trainer.out_dir={tmp_path / 'run'}",
        "trainer.total_steps=4",
        f"trainer.dist_timeout_s={timeout_s}",
        *SMALL,
        "reward.fn=tests.distributed.faulty_reward:digits_or_fail",
        f"reward.kwargs.how={how}",
        "reward.kwargs.fail_rank=1",
        "reward.kwargs.fail_step=2",
        f"reward.kwargs.fault_file={tmp_path / 'fault'}",
    ]


def _root_cause(output: str) -> str:
    """torchrun's 'Root Cause (first observed failure)' section of its error summary."""
    assert "Root Cause" in output, output[-3000:]
    return output.split("Root Cause", 1)[1]


def test_killed_rank_ends_the_job(tmp_path, tiny_model_dir):
    """SIGKILL rank 1 while rank 0 waits for it in a collective: torchrun returns non-zero at once, naming rank 1."""
    with Job(tmp_path) as job:
        job.single_node(2, _overrides(tmp_path, tiny_model_dir, "hang", LONG_TIMEOUT_S))
        job.wait_for_file(str(tmp_path / "fault"), START_S)
        os.kill(int((tmp_path / "fault").read_text()), signal.SIGKILL)
        t_fault = time.monotonic()
        [rc] = job.wait(NOTICED_S)
        took = time.monotonic() - t_fault
        out = job.output(0)
    assert rc is not None, f"torchrun still running {NOTICED_S} s after rank 1 was killed:\n{out[-3000:]}"
    assert rc != 0, out[-3000:]
    cause = _root_cause(out)
    assert re.search(r"rank\s*: 1 ", cause) and "SIGKILL" in cause, cause
    print(f"killed rank 1: torchrun returned {rc} {took:.1f} s after the kill")


def test_exception_on_one_rank_ends_the_job(tmp_path, tiny_model_dir):
    """Rank 1 raises inside ROLLOUT: it says so in one line, torchrun's summary carries its error, the job ends."""
    with Job(tmp_path) as job:
        job.single_node(2, _overrides(tmp_path, tiny_model_dir, "raise", LONG_TIMEOUT_S))
        t_fault = job.wait_for_file(str(tmp_path / "fault"), START_S)
        [rc] = job.wait(NOTICED_S)
        took = time.monotonic() - t_fault
        out = job.output(0)
    assert rc is not None, f"torchrun still running {NOTICED_S} s after rank 1 raised:\n{out[-3000:]}"
    assert rc != 0, out[-3000:]
    line = re.search(r"^hybrid_rl: rank 1/2 .*$", out, re.M)
    assert line, f"no failure line from rank 1:\n{out[-3000:]}"
    assert "at step 2, last phase rollout, in " in line[0] and "compute_rewards" in line[0], line[0]
    assert "injected failure on rank 1 at step 2" in line[0], line[0]
    # `report_failures` hands the error to torchrun (`record`), whose summary then shows it.
    cause = _root_cause(out)
    assert re.search(r"rank\s*: 1 ", cause) and "injected failure on rank 1 at step 2" in cause, cause
    print(f"exception on rank 1: torchrun returned {rc} {took:.1f} s after the raise")


def test_frozen_node_is_timed_out_by_the_other(tmp_path, tiny_model_dir):
    """Two launchers, so no agent tears the other node down. Node 1 freezes (SIGSTOP of its launcher and
    worker: sockets stay open, as when a machine loses power or the network) while rank 0 waits for it in
    a collective; rank 0 gives up after trainer.dist_timeout_s, names rank 1, and node 0 exits non-zero."""
    with Job(tmp_path) as job:
        job.multi_node(2, _overrides(tmp_path, tiny_model_dir, "hang", SHORT_TIMEOUT_S))
        job.wait_for_file(str(tmp_path / "fault"), START_S)
        for pid in (int((tmp_path / "fault").read_text()), job.procs[1].pid):
            os.kill(pid, signal.SIGSTOP)
        t_fault = time.monotonic()
        [rc0] = job.wait(SHORT_TIMEOUT_S + MARGIN_S, which=[0])
        took = time.monotonic() - t_fault
        out = job.output(0)
    assert rc0 is not None, (
        f"node 0 still running {SHORT_TIMEOUT_S + MARGIN_S} s after node 1 froze "
        f"(trainer.dist_timeout_s={SHORT_TIMEOUT_S}):\n{out[-3000:]}"
    )
    assert rc0 != 0, out[-3000:]
    line = re.search(r"^hybrid_rl: rank 0/2 .*$", out, re.M)
    assert line, f"no failure line from rank 0:\n{out[-3000:]}"
    assert "Timed out" in line[0] and "rank 1 reported no failure" in line[0], line[0]
    print(f"frozen node 1: node 0 returned {rc0} {took:.1f} s after the freeze (timeout {SHORT_TIMEOUT_S} s)")


def test_killed_rollout_rank_ends_a_split_job(tmp_path, tiny_model_dir):
    """trainer.placement=split: SIGKILL the rollout rank (rank 1) while the learner waits for its batch; the job
    ends at once, non-zero, and torchrun's summary names rank 1.
    Catches: a learner receive with no timeout or one that swallows the lost peer (the job would hang)."""
    overrides = _overrides(tmp_path, tiny_model_dir, "hang", LONG_TIMEOUT_S) + ["trainer.placement=split"]
    with Job(tmp_path) as job:
        job.single_node(2, overrides)
        job.wait_for_file(str(tmp_path / "fault"), START_S)
        os.kill(int((tmp_path / "fault").read_text()), signal.SIGKILL)
        [rc] = job.wait(NOTICED_S)
        out = job.output(0)
    assert rc is not None, f"torchrun still running {NOTICED_S} s after the rollout rank was killed:\n{out[-3000:]}"
    assert rc != 0, out[-3000:]
    cause = _root_cause(out)
    assert re.search(r"rank\s*: 1 ", cause) and "SIGKILL" in cause, cause
    # torchrun tears the learner down at once; a learner that outlives it names the peer itself
    # (PeerError, tests/distributed/test_split_ranks.py: dead and silent rollout ranks)
