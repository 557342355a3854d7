"""The split placement's validation schedule (hybrid_rl/split/validation.py), against the colocated fit() loop's
own condition and the rollout ranks' batch schedule (schedule.syncs_before), for every small fit."""

from __future__ import annotations

import itertools

import pytest

from hybrid_rl.split.schedule import syncs_before
from hybrid_rl.split.validation import ResidentEngine, validation_steps, validation_syncs


def _colocated_steps(first: int, total: int, val_every: int, before: bool) -> list[int]:
    """The steps colocated fit() validates after, written as its loop is (trainer.py fit)."""
    out = [0] if before and first == 0 else []
    step = first
    for i in range(total):
        step += 1
        if val_every and (step % val_every == 0 or i == total - 1):
            out.append(step)
    return out


def _batch_syncs(first: int, last: int, k: int) -> set[int]:
    """The versions the rollout ranks receive for their batches: the resumed one, then syncs_before each batch."""
    held, got = first, {first} if first > 0 else set()
    for b in range(first, last + 1):
        for v in syncs_before(b, held, k):
            got.add(v)
            held = v
    return got


CASES = list(itertools.product([0, 3], [0, 1, 2, 5], [0, 1, 2, 3], [False, True], [0, 1, 2]))


@pytest.mark.parametrize("first,total,every,before,k", CASES)
def test_the_split_schedule_validates_the_steps_colocated_does_and_every_version_reaches_the_rollout_ranks(
    first, total, every, before, k
):
    """Catches: a validation at another step than colocated's (the last step, step 0 of a resumed fit), a
    validated version the rollout ranks never receive (they would wait for it; the learner would wait for its
    metrics), or one sent twice (a second sync of a version the batches already brought)."""
    last = first + total - 1
    steps = validation_steps(first, last, every, before)
    assert steps == _colocated_steps(first, total, every, before)
    regular = _batch_syncs(first, last, k)
    extra = validation_syncs(steps, last, k)
    assert set(extra).isdisjoint(regular), (extra, regular)
    assert {s for s in steps if s > 0} <= regular | set(extra)
    # The extra versions come after every batch's: the rollout ranks receive versions in increasing order.
    assert all(v > max(regular, default=0) for v in extra)


def test_the_resident_engine_yields_the_engine_and_reports_no_switch():
    engine = object()
    phases = ResidentEngine(engine)
    with phases.recovering(), phases.rollout() as got:
        assert got is engine
    with phases.train():
        pass
    assert phases.pop_stats().seconds == {}
