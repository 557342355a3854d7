"""The one-line failure report's "where" (distributed.failure_context / failure_line), without a Trainer.

Catches: the report reading the outer (fit-level) tag instead of the failing step's, a phase printed as
its enum repr, and a tag that replaces the error (the original exception must propagate unchanged).
The 2-rank path (torchrun, a reward that raises on rank 1 at step 2) is tests/distributed/test_dead_rank.py.
"""

from __future__ import annotations

import pytest

import hybrid_rl.runtime.distributed as D
from hybrid_rl.switch.phases import Phase
from hybrid_rl.types import SamplingParams


def _fail():
    SamplingParams(max_new_tokens=0)  # raises inside the library: its frame is in the report's chain


def test_innermost_tag_wins_and_the_error_propagates():
    with pytest.raises(ValueError, match="max_new_tokens") as info:
        with D.failure_context(lambda: (3, None)):  # fit: between steps
            with D.failure_context(lambda: (4, Phase.ROLLOUT)):  # step: the failing step
                _fail()
    line = D.failure_line(info.value)
    assert " failed at step 4, last phase rollout, in " in line, line
    assert "SamplingParams.__post_init__" in line and "ValueError: max_new_tokens must be > 0" in line, line


def test_untagged_error_reports_only_library_frames():
    with pytest.raises(ValueError) as info:
        _fail()
    line = D.failure_line(info.value)
    assert " at step " not in line and " in " in line and "__post_init__" in line, line


def test_a_failing_where_does_not_hide_the_error():
    def broken():
        raise KeyError("no phases yet")

    with pytest.raises(ValueError, match="max_new_tokens") as info:
        with D.failure_context(broken):
            _fail()
    assert " at step " not in D.failure_line(info.value)
