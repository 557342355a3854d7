"""The partial-rollout pool (loop/partial.py): which rows start, what one engine call asks for, how results are
appended, which groups train, which are dropped as stale, and what the checkpoint holds.

Oracles: hand-written tables of tokens, budgets and versions, and a naive re-statement of the oldest-token rule."""

from __future__ import annotations

import io

import pytest
import torch

from hybrid_rl.loop.partial import PartialRollouts
from hybrid_rl.types import Completion

ROWS = [{"i": i} for i in range(64)]


class Loader:
    """A prompt loader stand-in: batches of `size` rows of ROWS, in order."""

    def __init__(self, size: int):
        self.size, self.drawn = size, 0

    def next_batch(self) -> list[dict]:
        rows = ROWS[self.drawn : self.drawn + self.size]
        self.drawn += self.size
        return rows


def encode(row: dict) -> list[int]:
    return [100 + row["i"], 7]


def _pool(G=2, batch=2, over=1.5, stop=1.0, max_new=6, min_new=0) -> PartialRollouts:
    return PartialRollouts(G, batch, over, stop, max_new, min_new, ROWS)


def test_refill_keeps_the_groups_in_flight_from_whole_loader_batches():
    pool, loader = _pool(batch=2, over=1.5), Loader(2)  # ceil(1.5 x 2) = 3 groups in flight
    assert pool.refill(0, loader, encode) == 3
    assert [g.row["i"] for g in pool.groups] == [0, 1, 2] and [r["i"] for r, _ in pool.queue] == [3]
    assert loader.drawn == 4  # two whole batches, the last row waits in the queue
    assert [g.prompt_ids for g in pool.groups] == [[100, 7], [101, 7], [102, 7]]
    assert all(len(g.samples) == 2 and g.started == 0 for g in pool.groups)


def test_the_plan_continues_each_unfinished_sample_with_the_rest_of_its_budget():
    pool = _pool(G=2, batch=2, over=1.0, max_new=6, min_new=3)
    pool.refill(0, Loader(2), encode)
    a, b = pool.groups
    a.samples[0].token_ids, a.samples[0].logprobs, a.samples[0].versions = [4, 5], [-0.1, -0.2], [0, 0]
    a.samples[1].token_ids, a.samples[1].finish_reason = [9], "stop"
    plan = pool.plan()
    assert plan.prompt_ids == [[100, 7, 4, 5], [101, 7], [101, 7]]
    assert plan.request.max_new_tokens == (4, 6, 6)
    assert plan.request.min_new_tokens == (1, 3, 3)
    assert plan.request.group_of == (0, 1, 1)
    assert plan.request.groups_needed == 2 and plan.continued == 1
    b.samples[0].finish_reason = b.samples[1].finish_reason = "length"  # group b complete already: one needed
    b.samples[0].token_ids = b.samples[1].token_ids = [3] * 6
    assert pool.plan().request.groups_needed == 1


def test_absorb_appends_tokens_log_probs_and_the_version_of_each():
    pool = _pool(G=1, batch=1, over=1.0)
    pool.refill(0, Loader(1), encode)
    s = pool.groups[0].samples[0]
    plan = pool.plan()
    pool.absorb(plan, [Completion([4, 5], [-0.5, -0.25], "abort")], version=3)
    plan = pool.plan()
    assert plan.prompt_ids == [[100, 7, 4, 5]] and plan.request.max_new_tokens == (4,)
    pool.absorb(plan, [Completion([6, 1], [-1.0, -2.0], "stop")], version=4)
    assert (s.token_ids, s.logprobs, s.versions, s.finish_reason) == (
        [4, 5, 6, 1],
        [-0.5, -0.25, -1.0, -2.0],
        [3, 3, 4, 4],
        "stop",
    )
    with pytest.raises(RuntimeError, match="2 completions for 0 prompts"):
        pool.absorb(pool.plan(), [Completion([], [], "abort")] * 2, version=5)


def test_absorb_keeps_the_versions_a_completion_carries():
    """Weights taken in flight (split, trainer.inflight_update=continue): a completion tags each of its tokens with
    the version that sampled it, and the pool keeps those, not the call's version. Oracle: the completion's own."""
    pool = _pool(G=1, batch=1, over=1.0)
    pool.refill(0, Loader(1), encode)
    s = pool.groups[0].samples[0]
    pool.absorb(pool.plan(), [Completion([4, 5, 6], [-0.5] * 3, "abort", versions=[3, 4, 4])], version=3)
    assert s.versions == [3, 4, 4]


def test_take_hands_out_the_oldest_complete_groups_and_carries_the_rest():
    pool = _pool(G=1, batch=2, over=2.0)
    pool.refill(0, Loader(2), encode)
    for g, reason in zip(pool.groups, ["abort", "stop", "length", "stop"]):
        g.samples[0].finish_reason = reason
    assert pool.complete_count() == 2  # capped at the step's groups
    taken = pool.take(2)
    assert [g.row["i"] for g in taken] == [1, 2]
    assert [g.row["i"] for g in pool.groups] == [0, 3] and pool.carried_samples() == 2


def test_a_group_is_dropped_when_its_oldest_token_is_more_than_k_versions_behind():
    """The split placement's rule, read at the oldest token of any sample; a group without tokens is never stale."""
    pool = _pool(G=2, batch=5, over=1.0)
    pool.refill(0, Loader(5), encode)
    # versions of each sample's tokens, per group; the last group's first token is stale, its last one fresh
    table = [([], []), ([5], [3, 4]), ([1], []), ([2, 2], [5]), ([1, 5], [])]
    for g, (v0, v1) in zip(pool.groups, table):
        g.samples[0].versions, g.samples[1].versions = list(v0), list(v1)
        g.samples[0].token_ids, g.samples[1].token_ids = [0] * len(v0), [0] * len(v1)
    step, k = 5, 3
    naive = [any(vs and step - vs[0] > k for vs in pair) for pair in table]
    assert pool.drop_stale(step, k) == (sum(naive), 2 * sum(naive))
    assert [g.row["i"] for g in pool.groups] == [i for i, stale in enumerate(naive) if not stale] == [0, 1, 3]


def test_a_prefix_that_fills_the_budget_finishes_as_length():
    """A resume with a smaller rollout.max_new_tokens: the prefix is kept whole and finished, never sent."""
    pool = _pool(G=1, batch=1, over=1.0, max_new=3)
    pool.refill(0, Loader(1), encode)
    s = pool.groups[0].samples[0]
    s.token_ids, s.logprobs, s.versions = [4, 5, 6, 7], [-1.0] * 4, [0] * 4
    plan = pool.plan()
    assert plan.prompt_ids == [] and plan.cut == 1 and s.finish_reason == "length" and pool.groups[0].complete


def test_the_state_round_trips_through_a_weights_only_load():
    pool, loader = _pool(G=2, batch=2, over=1.5), Loader(2)
    pool.refill(0, loader, encode)
    plan = pool.plan()
    out = [Completion([3, 4][: i % 3], [-0.125, -0.75][: i % 3], "abort" if i % 2 else "stop") for i in range(6)]
    pool.absorb(plan, out, version=0)
    buf = io.BytesIO()
    torch.save(pool.state_dict(), buf)
    buf.seek(0)
    again = _pool(G=2, batch=2, over=1.5)
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert again.state_dict() == pool.state_dict()
    assert again.plan().prompt_ids == pool.plan().prompt_ids
    assert [g.row for g in again.groups] == [g.row for g in pool.groups] and again.groups[0].row is ROWS[0]
    assert pool.state_dict()["groups"][2]["row"] == 2 and pool.state_dict()["queue"][0]["row"] == 3
    with pytest.raises(ValueError, match="row 3 of a dataset of 2 rows"):
        PartialRollouts(2, 2, 1.5, 1.0, 6, 0, ROWS[:2]).load_state_dict(pool.state_dict())
    with pytest.raises(ValueError, match="rollout.n=3"):
        _pool(G=3).load_state_dict(pool.state_dict())


def test_kept_caches_follow_their_samples_and_the_checkpoint():
    """rollout.partial_kv=keep: a row cut with tokens takes the cache the engine kept; a row the engine did not start
    keeps the one it had; a finished row lets it go; the next plan sends each cache with its row; the state carries
    them through a weights_only load, and a run with keep off loads the samples without them."""
    pool = PartialRollouts(1, 2, 1.5, 1.0, 6, 0, ROWS, keep_kv=True)  # 3 groups of 1
    pool.refill(0, Loader(2), encode)
    a, b, c = (g.samples[0] for g in pool.groups)
    plan = pool.plan()
    assert plan.request.keep_kv and plan.request.kv == ()  # no cache yet: none sent
    kv = [torch.full((1, 2, 1, 3, 2), float(i)) for i in range(3)]
    pool.absorb(plan, [Completion([4, 5], [-0.5, -0.5], "abort")] * 2 + [Completion([6], [-1.0], "stop")], 0, kv)
    assert a.kv is kv[0] and b.kv is kv[1] and c.kv is None  # c finished: its cache goes
    plan = pool.plan()
    assert plan.targets == [a, b] and plan.request.kv == (kv[0], kv[1])
    unstarted = Completion([], [], "abort")
    pool.absorb(plan, [Completion([7], [-0.25], "abort"), unstarted], 1, [torch.zeros(1, 2, 1, 4, 2), None])
    assert a.kv.shape[3] == 4 and b.kv is kv[1]  # a advanced: its new cache; b not started: the old one
    buf = io.BytesIO()
    torch.save(pool.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    again = PartialRollouts(1, 2, 1.5, 1.0, 6, 0, ROWS, keep_kv=True)
    again.load_state_dict(state)
    got = [g.samples[0].kv for g in again.groups if not g.complete]
    assert torch.equal(got[0], a.kv) and torch.equal(got[1], kv[1])
    off = PartialRollouts(1, 2, 1.5, 1.0, 6, 0, ROWS)
    off.load_state_dict(state)
    assert all(g.samples[0].kv is None for g in off.groups) and off.plan().request.kv == ()
    plain = _pool(G=1, batch=2)
    plain.refill(0, Loader(2), encode)
    plan = plain.plan()
    plain.absorb(plan, [Completion([4], [-0.5], "abort")] * 3, 0, kv)
    assert all(g.samples[0].kv is None for g in plain.groups), "keep off: nothing kept whatever the engine returns"


def test_a_budget_cut_sample_lets_its_cache_go_and_the_next_rows_keep_theirs():
    """A resume with a smaller rollout.max_new_tokens finishes a kept sample whose prefix fills it ("length"): its
    cache goes, and the next sample's cache stays with its own row in the request."""
    pool = PartialRollouts(3, 1, 1.0, 1.0, 6, 0, ROWS, keep_kv=True)  # 1 group of 3
    pool.refill(0, Loader(1), encode)
    a, b, c = pool.groups[0].samples
    kv = [torch.full((1, 2, 1, n, 2), float(n)) for n in (3, 4, 5)]
    plan = pool.plan()
    pool.absorb(
        plan,
        [
            Completion([4, 5], [-0.5] * 2, "abort"),
            Completion([4] * 3, [-0.5] * 3, "abort"),
            Completion([4] * 4, [-0.5] * 4, "abort"),
        ],
        0,
        kv,
    )
    assert (a.kv, b.kv, c.kv) == (kv[0], kv[1], kv[2])
    state = pool.state_dict()
    small = PartialRollouts(3, 1, 1.0, 1.0, 3, 0, ROWS, keep_kv=True)  # resumed with max_new_tokens 3: b is whole
    small.load_state_dict(state)
    a2, b2, c2 = small.groups[0].samples
    plan = small.plan()
    assert plan.targets == [a2] and plan.cut == 2
    assert plan.request.kv == (a2.kv,) and torch.equal(a2.kv, kv[0])
    assert b2.kv is None and c2.kv is None, "a sample finished by the budget cut still holds its cache"


def test_a_dropped_stale_group_takes_its_caches_with_it():
    """The staleness rule drops a group with its caches: nothing of it reaches the next request."""
    pool = PartialRollouts(1, 1, 2.0, 1.0, 6, 0, ROWS, keep_kv=True)
    pool.refill(0, Loader(1), encode)
    plan = pool.plan()
    kv = [torch.zeros(1, 2, 1, 3, 2), torch.ones(1, 2, 1, 3, 2)]
    pool.absorb(plan, [Completion([4, 5], [-0.5] * 2, "abort")] * 2, 0, kv)
    assert pool.drop_stale(5, 1) == (2, 2)
    assert pool.groups == [] and pool.plan().request.kv == ()


def test_a_row_that_advanced_without_a_new_cache_lets_the_old_one_go():
    """A cut row the engine returned tokens for but no cache (an engine that keeps none): the old cache no longer
    covers the row, so the sample holds none and is recomputed next time."""
    pool = PartialRollouts(1, 1, 1.0, 1.0, 6, 0, ROWS, keep_kv=True)
    pool.refill(0, Loader(1), encode)
    (s,) = pool.groups[0].samples
    pool.absorb(pool.plan(), [Completion([4, 5], [-0.5] * 2, "abort")], 0, [torch.zeros(1, 2, 1, 3, 2)])
    pool.absorb(pool.plan(), [Completion([7], [-0.1], "abort")], 1, [None])
    assert s.kv is None and pool.plan().request.kv == ()


def test_a_sample_that_finishes_lets_the_cache_it_had_go():
    """A sample cut with a kept cache, then finished ("stop", or "length" at its budget) in the next call: it holds
    no cache any more, neither the old one nor one the engine returned for it. Catches: a finished sample keeping its
    cache (host memory and every checkpoint grow by it)."""
    pool = PartialRollouts(2, 1, 1.0, 1.0, 6, 0, ROWS, keep_kv=True)  # 1 group of 2
    pool.refill(0, Loader(1), encode)
    a, b = pool.groups[0].samples
    old = [torch.zeros(1, 2, 1, 3, 2), torch.ones(1, 2, 1, 3, 2)]
    pool.absorb(pool.plan(), [Completion([4, 5], [-0.5] * 2, "abort")] * 2, 0, old)
    assert a.kv is old[0] and b.kv is old[1]
    new = [torch.full((1, 2, 1, 4, 2), 2.0), torch.full((1, 2, 1, 6, 2), 3.0)]
    pool.absorb(pool.plan(), [Completion([6], [-0.1], "stop"), Completion([6] * 4, [-0.1] * 4, "length")], 1, new)
    assert a.done and b.done and a.kv is None and b.kv is None
    assert pool.state_dict()["groups"][0]["samples"][0].get("kv") is None
