"""The native engine's partial rollout (issue 37, types.PartialRequest): per-row budgets and minimums, the early stop
once enough groups have finished, and a carried prefix continued from token ids.

Oracles: the same engine's uninterrupted greedy run (a continuation must reproduce it token for token, an aborted row
must hold its prefix), and separate plain calls per row for the per-row limits. `sharp_model` (tests/conftest.py)
makes greedy decoding depend on the context, so equality is a real check.
"""

from __future__ import annotations

import pytest

from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.types import PartialRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]
T = 10


def _greedy(max_new: int = T, min_new: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, min_new_tokens=min_new, greedy=True)


def _request(max_new, min_new=None, groups=None, needed=None) -> PartialRequest:
    n = len(max_new)
    groups = tuple(range(n)) if groups is None else tuple(groups)
    return PartialRequest(
        tuple(max_new),
        tuple([0] * n if min_new is None else min_new),
        groups,
        len(set(groups)) if needed is None else needed,
    )


@pytest.fixture
def engine(sharp_model):
    return NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS)


def test_a_carried_prefix_continues_to_the_uninterrupted_greedy_tokens(engine):
    """Each row cut after k of its tokens (0 included) and continued from prompt + prefix with the rest of its budget:
    prefix + continuation is the uninterrupted run, token for token, with its finish reason.
    Catches: an off-by-one budget, a prefix re-sampled, positions of a continued row shifted."""
    ref = engine.generate(PROMPTS, _greedy(min_new=6))  # long enough that every cut is inside the completion
    cuts = [0, 3, 5, 2]
    assert all(len(r.token_ids) > k for r, k in zip(ref, cuts))
    prompts = [p + r.token_ids[:k] for p, r, k in zip(PROMPTS, ref, cuts)]
    part = _request([T - k for k in cuts], [max(0, 6 - k) for k in cuts])
    got = engine.generate(prompts, _greedy(), part)
    for r, g, k in zip(ref, got, cuts):
        assert r.token_ids[:k] + g.token_ids == r.token_ids
        assert g.finish_reason == r.finish_reason
        assert g.logprobs == pytest.approx(r.logprobs[k:], abs=1e-5)


def test_without_a_stop_the_partial_path_samples_what_the_plain_call_samples(engine):
    """Every row at the full budget and no early stop: the same tokens and log-probs as a call without a
    PartialRequest, sampled (one uniform per row and step either way). Catches: the limits path drawing or
    masking differently."""
    sp = SamplingParams(max_new_tokens=T, seed=7, min_new_tokens=2)
    plain = engine.generate(PROMPTS, sp)
    part = engine.generate(PROMPTS, sp, _request([T] * 4, [2] * 4))
    assert [(c.token_ids, c.logprobs, c.finish_reason) for c in part] == [
        (c.token_ids, c.logprobs, c.finish_reason) for c in plain
    ]


def test_each_row_keeps_its_own_budget_and_minimum(engine):
    """Row limits against one plain call per row with the same limits. Catches: one row's limit applied to all,
    a budget of k giving k - 1 or k + 1 tokens, a minimum ignored."""
    budgets, minimums = [3, T, 1, 7], [3, 6, 0, 0]
    got = engine.generate(PROMPTS, _greedy(), _request(budgets, minimums))
    for p, g, hi, lo in zip(PROMPTS, got, budgets, minimums):
        (one,) = engine.generate([p], _greedy(hi, lo))
        assert (g.token_ids, g.finish_reason) == (one.token_ids, one.finish_reason)
        assert len(g.token_ids) <= hi and (g.finish_reason == "stop" or len(g.token_ids) == hi)
    assert got[0].finish_reason == "length" and len(got[0].token_ids) == 3


def test_the_rollout_stops_once_enough_groups_have_finished(engine):
    """Groups {0, 1} (2-token budgets) and {2, 3} (10 tokens, no stop allowed): with one group needed the call
    returns after 2 tokens; rows 2 and 3 come back "abort" holding the uninterrupted run's first 2 tokens, and the
    engine then decodes the same batch whole. Catches: the stop never taken, the wrong rows aborted, an aborted row
    without its prefix, a stop that leaves state behind."""
    ref = engine.generate(PROMPTS, _greedy(min_new=T))
    part = _request([2, 2, T, T], [2, 2, T, T], groups=[0, 0, 1, 1], needed=1)
    got = engine.generate(PROMPTS, _greedy(), part)
    assert [c.finish_reason for c in got] == ["length", "length", "abort", "abort"]
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids[:2]
        assert g.logprobs == pytest.approx(r.logprobs[:2], abs=1e-6)
    assert engine.last_generated_tokens == 8
    again = engine.generate(PROMPTS, _greedy(min_new=T))
    assert [c.token_ids for c in again] == [c.token_ids for c in ref]


def test_a_decode_batch_after_the_stop_is_not_started(sharp_model):
    """Two decode batches (max_batch_size=2): the first holds the needed group; the second comes back unstarted,
    "abort" with no tokens. With none needed nothing is decoded."""
    engine = NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS, max_batch_size=2)
    got = engine.generate(PROMPTS, _greedy(), _request([T] * 4, groups=[0, 0, 1, 1], needed=1))
    assert [c.finish_reason for c in got[2:]] == ["abort", "abort"] and all(not c.token_ids for c in got[2:])
    assert all(c.finish_reason != "abort" for c in got[:2])
    none = engine.generate(PROMPTS, _greedy(), _request([T] * 4, needed=0))
    assert all(c.finish_reason == "abort" and not c.token_ids for c in none)
    assert engine.last_generated_tokens == 0


def test_the_tail_is_the_time_with_fewer_than_half_the_rows_decoding(engine, monkeypatch):
    """One row of four runs 40 tokens, the others 2: the tail is most of the call; all rows equally long: none.
    The clock is a counter (one tick a read), so the seconds are the checks counted."""
    ticks = iter(range(10_000))
    monkeypatch.setattr("hybrid_rl.rollout.native.decode_loop.time.perf_counter", lambda: float(next(ticks)))
    engine.generate(PROMPTS, _greedy(40), _request([2, 2, 2, 40], [2, 2, 2, 40]))
    assert engine.last_tail_s == 38.0  # checks after tokens 2..39 with one row alive
    engine.generate(PROMPTS, _greedy(8), _request([8] * 4, [8] * 4))
    assert engine.last_tail_s == 0.0


def test_a_request_that_does_not_fit_its_call_is_refused(engine):
    with pytest.raises(ValueError, match="3 rows for 4 prompts"):
        engine.generate(PROMPTS, _greedy(), _request([T] * 3))
    with pytest.raises(ValueError, match="exceeds SamplingParams.max_new_tokens"):
        engine.generate(PROMPTS, _greedy(4), _request([T] * 4))
    with pytest.raises(ValueError, match="min_new_tokens"):
        _request([2], [3])
    assert len(engine.generate(PROMPTS, _greedy(2))) == 4
