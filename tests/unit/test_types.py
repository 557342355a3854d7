"""The shared vocabulary's logic (hybrid_rl/types.py): the stop rule counted over several ranks' PartialRequests.

Oracle: `groups_complete`, the rule's naive statement, recounted over each rank's rows after every finish."""

from __future__ import annotations

import random

import pytest

from hybrid_rl.types import PartialRequest, RankGroups, groups_complete


def _partial(hi, lo, group_of, needed) -> PartialRequest:
    return PartialRequest(tuple(hi), tuple(lo), tuple(group_of), needed)


def test_rank_groups_count_like_groups_complete_on_every_rank():
    """RankGroups (vLLM's TP-group stop, all_met; SGLang's per rank, met), counted as rows finish, against
    groups_complete over the rows of each rank (the naive count), for rows finishing in random orders: two ranks with
    their own group numbers, one without a PartialRequest (all its rows must finish), one with no rows.
    Catches: groups merged across ranks, a group counted complete before its last row, a rank's rule left out."""
    partials = [_partial([4] * 5, [0] * 5, [0, 1, 0, 2, 1], 2), None, _partial([4] * 3, [0] * 3, [0, 0, 1], 1), None]
    counts = [5, 2, 3, 0]
    rng = random.Random(0)
    for _ in range(50):
        stop = RankGroups(partials, counts)
        finished = [False] * 10
        order = list(range(10))
        rng.shuffle(order)
        for row in order:
            finished[row] = True
            stop.finish(row)
            mine = [finished[0:5], finished[5:7], finished[7:10]]
            want = (
                groups_complete(partials[0].group_of, mine[0]) >= 2
                and all(mine[1])
                and groups_complete(partials[2].group_of, mine[2]) >= 1
            )
            assert stop.all_met() == want


def test_a_rank_whose_request_does_not_match_its_rows_is_refused():
    with pytest.raises(ValueError, match="rank 1: a PartialRequest of 2 rows for 3 prompts"):
        RankGroups([None, _partial([4, 4], [0, 0], [0, 1], 1)], [1, 3])
