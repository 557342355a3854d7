"""Staleness bookkeeping of the split placement (hybrid_rl/split/staleness.py, schedule.py, groups.py):
admission, rejection, the bounded queue, and the protocol simulated over 50 steps with the library's own
functions, so an off-by-one in admission or rejection shows as a lag above k, a lag never reaching k,
a drop, or a deadlock."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_rl.algorithms.correction import rollout_correction
from hybrid_rl.split.groups import to_rollout_batch, token_versions_NT
from hybrid_rl.split.schedule import simulate, steady_period, syncs_before
from hybrid_rl.split.staleness import (
    LearnerQueue,
    QueueFull,
    StalenessRule,
    VersionedGroup,
    may_start,
    staleness_metrics,
    version_for_batch,
)
from hybrid_rl.types import Completion


def group(version: int, row: int = 0, token_versions=None, logps=(-0.5, -1.0)) -> VersionedGroup:
    comps = [Completion([5, 6], list(logps), "stop"), Completion([7, 1], [-2.0, -0.25], "length")]
    return VersionedGroup(row, [2, 3], comps, [1.0, 0.0], [1.0, 0.0], version, token_versions)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_admission_allows_exactly_k_versions_ahead(k):
    for b in range(10):
        for v in range(b + 1):
            assert may_start(b, v, k) == (b - v <= k), (b, v, k)
        assert may_start(b, version_for_batch(b, k), k)
        assert version_for_batch(b, k) == 0 or not may_start(b, version_for_batch(b, k) - 1, k)


def test_k0_receives_the_version_of_the_batch_itself():
    assert syncs_before(0, 0, 0) == []
    assert syncs_before(3, 2, 0) == [3]
    assert syncs_before(3, 0, 1) == [1, 2]  # a rank that fell behind catches up version by version
    assert syncs_before(3, 2, 1) == []


def test_rule_trains_lag_k_and_drops_k_plus_one():
    for k in (0, 1, 2):
        rule = StalenessRule(k)
        assert rule.trainable(group(5), 5 + k)
        assert not rule.trainable(group(5), 5 + k + 1)


def test_rule_reads_the_oldest_token_of_a_partial_rollout():
    g = group(3, token_versions=[[3, 4], [4, 5]])
    assert g.oldest_version == 3 and g.newest_version == 5
    assert not StalenessRule(1).trainable(g, 5)  # the newest token is 0 old, the oldest 2
    assert StalenessRule(2).trainable(g, 5)


def test_token_versions_must_match_and_move_forward():
    with pytest.raises(ValueError, match="non-decreasing"):
        group(3, token_versions=[[4, 3], [3, 3]])
    with pytest.raises(ValueError, match=">= the group's start version"):
        group(3, token_versions=[[2, 3], [3, 3]])
    with pytest.raises(ValueError, match="2 tokens but 1 versions"):
        group(3, token_versions=[[3], [3, 3]])


def test_bad_knobs_name_their_keys():
    with pytest.raises(ValueError, match="trainer.max_staleness"):
        StalenessRule(-1)
    with pytest.raises(ValueError, match="trainer.stale_samples"):
        StalenessRule(1, "keep")


def test_queue_takes_in_order_drops_stale_and_is_bounded():
    q = LearnerQueue(capacity=4)
    q.put([group(0, row=0), group(2, row=1), group(1, row=2), group(3, row=3)])
    with pytest.raises(QueueFull, match="max_staleness"):
        q.put([group(3, row=4)])
    taken = q.take(2, learner_version=3, rule=StalenessRule(1))
    assert [g.row_index for g in taken.kept] == [1, 3] and taken.lags == [1, 0]
    assert [g.row_index for g in taken.dropped] == [0, 2] and len(q) == 0
    m = staleness_metrics(taken, len(q))
    assert m == {
        "split/staleness_mean": 0.5,
        "split/token_staleness_mean": 0.5,  # every token of a group its group's version: lags 1 x 4, 0 x 4
        "split/staleness_max": 1.0,
        "split/dropped": 2.0,
        "split/queue_depth": 0.0,
    }


def test_token_staleness_reads_each_tokens_own_version():
    """Learner version 4: a group of version 2 whose tokens are [2, 3] and [3, 4] (taken in flight, or carried) has
    lag 2, and its tokens lags 2, 1, 1, 0: mean 1 (hand arithmetic), beside a group of version 4 (lags 0 x 4)."""
    q = LearnerQueue(capacity=4)
    q.put([group(2, row=0, token_versions=[[2, 3], [3, 4]]), group(4, row=1)])
    m = staleness_metrics(q.take(2, learner_version=4, rule=StalenessRule(2)), 0)
    assert m["split/staleness_mean"] == 1.0 and m["split/token_staleness_mean"] == 0.5


def test_queue_stops_at_n_and_keeps_the_rest():
    q = LearnerQueue(capacity=8)
    q.put(group(4, row=r) for r in range(5))
    taken = q.take(3, 4, StalenessRule(0))
    assert [g.row_index for g in taken.kept] == [0, 1, 2] and len(q) == 2
    assert q.clear() == 2 and len(q) == 0


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("gen_s, train_s", [(1.0, 2.0), (2.0, 1.0), (1.0, 1.0)])
def test_fifty_steps_never_train_a_sample_older_than_k(k, gen_s, train_s):
    """Over 50 steps: every trained group lags at most k, none is dropped, and in steady state every lag is
    exactly k (the protocol takes version b - k for batch b): an admission one too loose gives k + 1, one
    too strict k - 1 (or a deadlock at k = 0)."""
    sim = simulate(k, 50, gen_s, train_s, sync_s=0.1)
    lags = [x for step in sim.lags for x in step]
    assert len(sim.lags) == 50 and len(lags) == 50 * 4
    assert max(lags) <= k and sim.dropped == 0
    assert all(x == k for step in sim.lags[k:] for x in step)
    assert sim.max_queue_depth <= 4 * k


def test_k0_strictly_alternates():
    sim = simulate(0, 20, 1.0, 2.0, sync_s=0.5)
    assert all(x == 0 for step in sim.lags for x in step)
    assert steady_period(sim) == pytest.approx(1.0 + 2.0 + 0.5)  # nothing overlaps
    assert sim.max_queue_depth == 4  # one batch at a time


def test_uneven_batches_keep_the_bound():
    """Long, uneven generations (every third batch 5x longer) still never exceed k."""
    sim = simulate(2, 50, lambda b: 5.0 if b % 3 == 0 else 1.0, 1.5, sync_s=0.2)
    assert max(x for step in sim.lags for x in step) <= 2 and sim.dropped == 0


def test_correction_uses_the_generating_engines_logprobs():
    """The batch the learner builds carries each token's log-prob from the engine that generated it, so the
    correction's ratio is exp(learner - generating policy), not 1 or another version's."""
    gen_logps = (-0.5, -1.0)
    groups = [group(2, row=1, logps=gen_logps)]
    batch = to_rollout_batch(groups, rows=[{"q": 0}, {"q": 1}], pad_id=0, device=torch.device("cpu"))
    assert batch.rows == [{"q": 1}] and batch.rewards_N.tolist() == [1.0, 0.0]
    assert batch.resp_mask_NT.tolist() == [[1.0, 1.0], [1.0, 1.0]]  # by hand: two 2-token completions
    old = torch.tensor([[-0.25, -1.5], [-2.0, -0.25]])  # the learner's log-probs at a later version
    weight, mask, _ = rollout_correction(old, batch.engine_logp_NT, batch.resp_mask_NT, "tis_token", cap=100.0)
    assert weight[0].tolist() == pytest.approx([math.exp(-0.25 + 0.5), math.exp(-1.5 + 1.0)])
    assert weight[1].tolist() == pytest.approx([1.0, 1.0])


def test_token_versions_tensor_pads_with_minus_one():
    g = group(3, token_versions=[[3, 4], [4, 4]])
    assert token_versions_NT([g, group(5)], 3).tolist() == [[3, 4, -1], [4, 4, -1], [5, 5, -1], [5, 5, -1]]
