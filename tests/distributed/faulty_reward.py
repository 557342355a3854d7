"""A digits reward that fails on one rank at one step: the fault injector of test_dead_rank.py.

Used as `reward.fn=tests.distributed.faulty_reward:digits_or_fail` with the repository
root on PYTHONPATH, and keyword arguments from the command line:

    reward.kwargs.fail_rank=1 reward.kwargs.fail_step=2 reward.kwargs.how=raise

how=raise    raise RuntimeError on that rank (every later call raises too, so the
             library's search for the failing sample finds one)
how=hang     sleep: the other ranks wait for this one in a collective until the test
             kills it or their process-group timeout ends the wait
how=none     never fail (a clean run through the same code path)

At the fault the failing rank writes its pid to `fault_file` (when given), so the test
knows when the fault happened and which process to kill.

The start-up probe (placeholder completions, response_tokens=0) is not counted as a step.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from hybrid_rl.rewards.toy import digits_reward

_calls = {"steps": 0, "failed": False}


def _is_probe(metadata: Sequence[dict]) -> bool:
    return all(m["finish_reason"] == "length" and m["response_tokens"] == 0 for m in metadata)


def digits_or_fail(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[dict],
    fail_rank: int = 1,
    fail_step: int = 2,
    how: str = "raise",
    fault_file: str = "",
) -> list[float]:
    rank = int(os.environ.get("RANK", "0"))
    if _calls["failed"]:
        raise RuntimeError(f"injected failure on rank {rank}")
    if not _is_probe(metadata):
        _calls["steps"] += 1
        if how != "none" and rank == fail_rank and _calls["steps"] == fail_step:
            if fault_file:
                with open(fault_file + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(fault_file + ".tmp", fault_file)
            if how == "hang":
                time.sleep(3600)
            _calls["failed"] = True
            raise RuntimeError(f"injected failure on rank {rank} at step {fail_step}")
    return digits_reward(prompts, completions, metadata)
