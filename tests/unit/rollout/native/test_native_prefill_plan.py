"""The native engine's prefill layout (`prefill_plan.py`): a stem shared by carried rows prefilled once, each row's own
tokens after it in a second forward over a masked gap, length buckets at slot offsets.

Oracles: the same engine on each row alone (nothing to share, no bucket), and the trainer's log-probs over prompt +
completion. `sharp_model` makes outputs depend on the whole context and on positions, so a suffix that attends to a
wrong slot, sits at a wrong position or reads another row's stem changes the first log-prob well beyond 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.rollout.native import engine as native
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.rollout.native.prefill_plan import Bucket, buckets, plan_prefill
from hybrid_rl.types import PartialRequest, SamplingParams
from tests.unit.rollout.native.test_native_engine_speedups import Recorder, assert_logprobs_match_trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]
G = 4


def carried_rows(engine) -> tuple[list[list[int]], list[int]]:
    """G sampled samples of each prompt, cut after 0..5 tokens (different cuts in a group, so the rows of one prompt
    differ in their prefixes and suffix lengths), interleaved as a partial rollout's carried groups are; and the
    number of distinct prompts."""
    sp = SamplingParams(max_new_tokens=8, min_new_tokens=8, seed=5)
    rows = []
    for i, p in enumerate(PROMPTS):
        comps = engine.generate([p] * G, sp)
        for g, c in enumerate(comps):
            rows.append(p + c.token_ids[: (i + 2 * g) % 6])
    return rows, len(PROMPTS)


def runs_whole(rows: list[list[int]], T: int) -> PartialRequest:
    """A partial rollout's request that stops nothing (every row its full budget, every group needed): the call whose
    layout may be wider than its longest row (NativeEngine._batch_limits)."""
    return PartialRequest((T,) * len(rows), (0,) * len(rows), tuple(range(len(rows))), len(rows))


@pytest.fixture
def engine(sharp_model):
    return NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS)


@pytest.mark.parametrize("forward_tokens", [0, 48, 10**6])  # a bucket per length .. one bucket
def test_rows_sharing_a_prompt_continue_as_each_row_alone(engine, sharp_model, monkeypatch, forward_tokens):
    """Carried rows (prompt + a prefix of its own, four per prompt, some with no prefix, one duplicated) against each
    row generated alone, greedy: the same tokens, the same log-probs (1e-5), and the trainer's log-probs. The shared
    layout must have run: one phase-1 row per distinct prompt. Catches: a suffix position off by one, the gap or the
    stem's padding unmasked, a suffix reading another prompt's stem, a bucket written at the wrong slots."""
    monkeypatch.setitem(native.FORWARD_TOKENS, "cpu", forward_tokens)
    rows, n_prompts = carried_rows(engine)
    rows.append(rows[5])  # a duplicate row: deduplicated, then copied
    sp = SamplingParams(max_new_tokens=6, greedy=True)
    with Recorder(sharp_model) as rec:
        got = engine.generate(rows, sp, runs_whole(rows, 6))
    plan = plan_prefill(rows, len(rows), forward_tokens)
    assert len(plan.stems) == n_prompts and plan.n_suffix > n_prompts, "the stems must be shared"
    assert sum(s[0] for s in rec.shapes[: len(plan.stem_buckets)]) == n_prompts
    assert engine.last_prefill_forwards == plan.forwards()
    for row, g in zip(rows, got):
        (alone,) = NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS).generate([row], sp)
        assert g.token_ids == alone.token_ids, row
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    assert_logprobs_match_trainer(sharp_model, rows, got, 1.0)


def test_sampled_continuations_of_shared_rows_match_the_trainer(engine, sharp_model):
    """Sampled, through the partial path (per-row budgets, one group per prompt): every row's log-probs equal the
    trainer's over its whole row + completion."""
    rows, _ = carried_rows(engine)
    budgets = [8 - (len(r) - len(PROMPTS[i // G])) for i, r in enumerate(rows)]
    part = PartialRequest(tuple(budgets), (0,) * len(rows), tuple(i // G for i in range(len(rows))), len(PROMPTS))
    got = engine.generate(rows, SamplingParams(max_new_tokens=8, seed=11), part)
    assert [len(c.token_ids) <= b for c, b in zip(got, budgets)] == [True] * len(rows)
    assert_logprobs_match_trainer(sharp_model, rows, got, 1.0)


def test_the_plan_shares_a_group_s_prompt_and_keeps_distinct_prompts_whole():
    prompt, other = (3, 4, 5, 14), (7, 8, 14)
    rows = [list(prompt) + [2, 2], list(prompt) + [6], list(prompt), list(other), list(other), list(prompt) + [6]]
    plan = plan_prefill(rows, chunk=8, forward_tokens=0)
    assert plan.stems == [other, prompt]  # shortest first
    assert (plan.P_s, plan.P_x, plan.n_suffix) == (4, 2, 2)
    assert [plan.suffix(u) for u in range(plan.n_suffix)] == [(6,), (2, 2)]  # shortest suffix first
    for n, r in enumerate(rows):  # every input row is its stem + suffix
        u = plan.src[n]
        assert plan.stems[plan.stem_of[u]] + plan.suffix(u) == tuple(r)
    assert plan.src[1] == plan.src[5] and plan.src[3] == plan.src[4]
    # Rows with nothing in common beyond MIN_STEM stay whole: no phase 2.
    whole = plan_prefill([[3, 4, 14], [3, 9, 14], [8, 14]], chunk=8, forward_tokens=0)
    assert whole.n_suffix == 0 and whole.P_x == 0 and len(whole.stems) == 3
    # A shared layout wider than the memory budget's slots falls back to whole rows.
    capped = plan_prefill(rows, chunk=8, forward_tokens=0, max_slots=5)
    assert capped.n_suffix == 0 and capped.P == 6


def test_a_group_gives_way_to_a_longer_shared_stem():
    """Eight rows of one 6-token prompt, then a row that shares only 2 of its tokens: it starts its own stem (the
    group would save 8 x 2 tokens instead of 7 x 6)."""
    p = [1, 2, 3, 4, 5, 6]
    rows = [p + [10 + i] for i in range(8)] + [[1, 2, 9, 9, 9]]
    plan = plan_prefill(rows, chunk=16, forward_tokens=0)
    assert sorted(plan.stems) == [(1, 2, 3, 4, 5, 6), (1, 2, 9, 9, 9)]


def test_a_call_without_a_partial_request_never_widens_the_cache(engine):
    """Rows whose shared layout needs 4 + 3 prompt slots (a stem (5, 6) of three rows, a whole 4-token row, a 3-token
    suffix) against a longest row of 5: a plain call keeps 5 slots (the cache the planner bills, the same every step:
    tests/recipes/test_no_leak.py), a partial call may widen to 7, with the same greedy tokens. A stem that fits the
    longest row is shared by a plain call too (a chat template's common prefix). Catches: a plain rollout whose KV
    cache grows with how much its prompts happen to share."""
    rows = [[5, 6, 7, 14], [5, 6, 9, 14], [8, 9, 10, 14], [5, 6, 7, 8, 14]]
    T, sp = 3, SamplingParams(max_new_tokens=3, greedy=True)
    assert plan_prefill(rows, 8, 0).P == 7 and plan_prefill(rows, 8, 0, max_slots=5).n_suffix == 0
    plain = engine.generate(rows, sp)
    kv_plain, forwards_plain = engine.last_kv_bytes, engine.last_prefill_forwards
    widened = engine.generate(rows, sp, runs_whole(rows, T))
    assert engine.last_kv_bytes * (5 + T - 1) == kv_plain * (7 + T - 1)  # bytes per slot alike
    assert engine.last_prefill_forwards > forwards_plain == 1
    assert [c.token_ids for c in widened] == [c.token_ids for c in plain]
    fits = [[5, 6, 7, 8, 14], [5, 6, 7, 9, 14], [5, 6, 7, 14]]  # stem (5, 6, 7) + suffixes of <= 2: 5 slots
    engine.generate(fits, sp)
    assert engine.last_prefill_forwards == 2 and engine.last_kv_bytes * 4 == kv_plain * 3  # 3 rows of 4, 5 slots


def test_buckets_cover_the_sorted_rows_in_chunks():
    lengths = [2, 2, 3, 9, 9, 9, 30]
    assert buckets(lengths, chunk=8, forward_tokens=10**6) == [Bucket(0, 7, 30)]
    per_length = [Bucket(0, 2, 2), Bucket(2, 3, 3), Bucket(3, 6, 9), Bucket(6, 7, 30)]
    assert buckets(lengths, chunk=8, forward_tokens=0) == per_length
    split = buckets(lengths, chunk=2, forward_tokens=5)
    assert split[0].a == 0 and split[-1].b == 7 and all(b.b - b.a <= 2 for b in split)
    assert all(x.b == y.a for x, y in zip(split, split[1:]))
    assert all(max(lengths[b.a : b.b]) <= b.L for b in split)


def test_an_attention_without_a_given_mask_prefills_whole_rows_in_one_bucket(engine, monkeypatch):
    """Where the attention is not sdpa or eager (flash-attention's varlen path), the plan shares no stem and makes
    one bucket of left-padded whole rows (chunked only by memory), as the engine did before stems and buckets."""
    rows, _ = carried_rows(engine)
    sp = SamplingParams(max_new_tokens=4, greedy=True)
    shared = engine.generate(rows, sp, runs_whole(rows, 4))
    assert engine.last_prefill_forwards > 1
    monkeypatch.setattr(native, "attention_implementation", lambda model: "flash_attention_2")
    monkeypatch.setattr(native, "choose_decode_path", lambda *a: native.DecodePath("forward", False))
    whole = engine.generate(rows, sp, runs_whole(rows, 4))
    assert engine.last_prefill_forwards == 1
    assert [c.token_ids for c in whole] == [c.token_ids for c in shared]
