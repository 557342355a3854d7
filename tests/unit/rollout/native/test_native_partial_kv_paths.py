"""rollout.partial_kv=keep on the native engine across its decode paths and batches (test_native_partial_kv.py has
the mechanism against the in-flight oracle): a row kept, continued, cut again and kept again, then continued to its
end, under unchanged weights equals the uninterrupted greedy run; rows with a stem/suffix gap (prefill_plan.py); a
decode batch left unstarted keeps its old cache; a cut in a later decode batch; in-flight updates over kept rows.
Each on the lean step, the model's forward and the CUDA-graph path's fixed shapes run eagerly (DecodeGraphs with
capture=False, as test_native_engine_speedups.py runs them on CPU)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from hybrid_rl.rollout.native.decode_graph import DecodeGraphs
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.rollout.native.prefill_plan import plan_prefill
from hybrid_rl.types import PartialRequest, SamplingParams
from tests.engine_helpers import SwapAt, perturbed, stale_kv_greedy

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
A = [5, 6, 7, 14, 11, 12]
ROWS = [A + [3, 4], A + [9], [8, 14]]  # two rows of one stem (the shorter suffix has a gap), one alone
F1, F2 = [10, 3, 14], [9, 9, 14]
T, C1, C2 = 12, 3, 4


def _greedy(t=T) -> SamplingParams:
    return SamplingParams(max_new_tokens=t, min_new_tokens=t, greedy=True)


def _engine(model, path: str, max_batch_size: int = 0, every: int | None = None) -> NativeEngine:
    eng = NativeEngine(
        model,
        pad_id=PAD,
        eos_id=EOS,
        max_batch_size=max_batch_size,
        lean_step=path != "forward",
        stop_check_every=every,
    )
    if path == "graph":
        real = eng._decode_path

        def graph_path(dev):
            p = real(dev)
            assert p.name == "lean"
            return replace(p, name="cuda_graph")

        eng._decode_path = graph_path
        eng._new_graphs = lambda cache, dev, lean: DecodeGraphs(eng.model, cache, dev, capture=False, lean=lean)
    return eng


def test_the_first_call_has_a_stem_gap():
    """The layout the tests below rely on: two rows of one stem, one of them with a masked gap after it."""
    plan = plan_prefill([F1, F2] + ROWS, 8, 48, True, None)
    assert plan.n_suffix == 2 and plan.P_x == 2  # A+[9]'s suffix is left-padded: one masked slot after the stem


@pytest.mark.parametrize("every", [None, 3])
@pytest.mark.parametrize("path", ["lean", "forward", "graph"])
@pytest.mark.parametrize("mbs", [0, 3])
def test_kept_twice_equals_the_uninterrupted_run(sharp_model, path, mbs, every):
    """Catches: a kept cache that misses a slot of a stem/suffix gap or of a second continuation, an unstarted batch
    whose rows lose their cache, any decode path reading the kept layout differently."""
    ref = NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS).generate(ROWS, _greedy())
    eng = _engine(copy.deepcopy(sharp_model), path, every=every)
    # call 1: F1 ends after 1 token, F2 after C1: the stop (2 groups) cuts the three rows after C1 tokens
    hi, lo = (1, C1) + (T,) * 3, (0, 0) + (T,) * 3
    first = eng.generate([F1, F2] + ROWS, _greedy(), PartialRequest(hi, lo, (0, 1, 2, 3, 4), 2, keep_kv=True))
    assert [c.finish_reason for c in first[2:]] == ["abort"] * 3
    held = [list(c.token_ids) for c in first[2:]]
    kv = list(eng.last_kept_kv[2:])
    for r, h, x in zip(ROWS, held, kv):
        assert x.shape[3] == len(r) + len(h) - 1
    # call 2: batches of mbs (3: [F1, F2, row0] cut after C2, [row1, row2] unstarted, keeping call 1's caches)
    eng2 = _engine(copy.deepcopy(sharp_model), path, mbs, every)
    rows2 = [F1, F2] + [r + h for r, h in zip(ROWS, held)]
    left = [T - len(h) for h in held]
    req2 = PartialRequest((1, C2, *left), (0, 0, *left), (0, 1, 2, 3, 4), 2, kv=(None, None, *kv), keep_kv=True)
    second = eng2.generate(rows2, _greedy(), req2)
    for i in range(3):
        c, new = second[2 + i], eng2.last_kept_kv[2 + i]
        if c.token_ids:
            assert c.finish_reason == "abort" and len(c.token_ids) >= C2
            held[i] += c.token_ids
            kv[i] = new
            assert new.shape[3] == len(ROWS[i]) + len(held[i]) - 1
        else:
            assert mbs and new is None  # unstarted: the old cache stays the row's
    if mbs:
        assert not second[3].token_ids and not second[4].token_ids
    # call 3: every row to its end, in batches of 2 (a compaction as rows end at different budgets)
    eng3 = _engine(copy.deepcopy(sharp_model), path, 2, every)
    rows3 = [r + h for r, h in zip(ROWS, held)]
    left = [T - len(h) for h in held]
    third = eng3.generate(rows3, _greedy(), PartialRequest(tuple(left), tuple(left), (0, 1, 2), 3, kv=tuple(kv)))
    for i in range(3):
        assert held[i] + third[i].token_ids == ref[i].token_ids, (i, held[i], third[i].token_ids, ref[i].token_ids)


@pytest.mark.parametrize("at", [1, 3])
@pytest.mark.parametrize("path", ["lean", "forward", "graph"])
def test_kept_rows_with_an_in_flight_update(sharp_model, path, at):
    """updates= with kv (the engine API allows it): the swap at poll `at` (1: before the prefill, 3: after 2 tokens)
    equals the in-flight oracle at mark = held + at - 1."""
    new = {n: p.detach().clone() for n, p in perturbed(copy.deepcopy(sharp_model), seed=7).named_parameters()}
    eng = _engine(copy.deepcopy(sharp_model), path)
    hi, lo = (1, C1) + (T,) * 3, (0, 0) + (T,) * 3
    first = eng.generate([F1, F2] + ROWS, _greedy(), PartialRequest(hi, lo, (0, 1, 2, 3, 4), 2, keep_kv=True))
    kv = list(eng.last_kept_kv[2:])
    rows = [r + c.token_ids for r, c in zip(ROWS, first[2:])]
    left = (T - C1,) * 3
    got = eng.generate(rows, _greedy(), PartialRequest(left, left, (0, 1, 2), 3, kv=tuple(kv)), SwapAt(eng, new, at))
    assert eng.last_update_marks == [[at - 1] * 3]
    for i in range(3):
        toks, _ = stale_kv_greedy(copy.deepcopy(sharp_model), new, ROWS[i], C1 + at - 1, T, {EOS}, min_new=T)
        assert first[2 + i].token_ids + got[i].token_ids == toks, i


@pytest.mark.parametrize("path", ["lean", "forward", "graph"])
def test_fresh_rows_with_a_stem_gap_beside_longer_kept_rows(sharp_model, path):
    """Fresh rows that share a stem (phase 2 with a masked gap), shifted right by a longer kept row: each equals its
    own uninterrupted run."""
    fresh = [A + [3], A + [2, 2, 4], [8, 14]]
    ref = NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS).generate(fresh + ROWS, _greedy())
    eng = _engine(copy.deepcopy(sharp_model), path)
    hi, lo = (1, C1 + 4) + (T,) * 3, (0, 0) + (T,) * 3
    first = eng.generate([F1, F2] + ROWS, _greedy(), PartialRequest(hi, lo, (0, 1, 2, 3, 4), 2, keep_kv=True))
    kv = list(eng.last_kept_kv[2:])
    rows = fresh + [r + c.token_ids for r, c in zip(ROWS, first[2:])]
    assert max(map(len, rows[3:])) > plan_prefill(fresh, 8, 48).P  # the kept rows widen the prompt slots
    n = len(first[2].token_ids)
    left = (T,) * 3 + (T - n,) * 3
    got = eng.generate(rows, _greedy(), PartialRequest(left, left, tuple(range(6)), 6, kv=(None,) * 3 + tuple(kv)))
    for i in range(3):
        assert got[i].token_ids == ref[i].token_ids, i
        assert got[i].logprobs == pytest.approx(ref[i].logprobs, abs=1e-4)
    for i in range(3):
        assert first[2 + i].token_ids + got[3 + i].token_ids == ref[3 + i].token_ids, i


@pytest.mark.parametrize("path", ["lean", "graph"])
def test_a_cut_in_the_second_decode_batch_keeps_at_the_right_row(sharp_model, path):
    """Batches of 2: [F1, F3] finish group 0; [F2, row] then reaches the stop (2 groups) and cuts `row`: its cache is
    last_kept_kv[3] (start + its index), and continued it equals the uninterrupted run."""
    row = ROWS[0]
    ref = NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS).generate([row], _greedy())
    eng = _engine(copy.deepcopy(sharp_model), path, 2)
    F3 = [4, 4, 14]
    req = PartialRequest((1, 2, C1, T), (0, 0, 0, T), (0, 0, 1, 2), 2, keep_kv=True)
    first = eng.generate([F1, F3, F2, row], _greedy(), req)
    assert [c.finish_reason for c in first] == ["length", "length", "length", "abort"]
    assert eng.last_kept_kv[:3] == [None] * 3 and eng.last_kept_kv[3] is not None
    kv = eng.last_kept_kv[3]
    left = T - len(first[3].token_ids)
    got = eng.generate([row + first[3].token_ids], _greedy(), PartialRequest((left,), (left,), (0,), 1, kv=(kv,)))
    assert first[3].token_ids + got[0].token_ids == ref[0].token_ids
