"""In-flight weight updates on the native engine (issue 37, trainer.inflight_update=continue; types.WeightUpdates):
`generate(..., updates=)` polls before each decode batch and at each stop check, applies a version there in place,
and decodes on over the cache the old weights wrote; `last_update_marks` says how many tokens each row held then.

Oracle: tests/engine_helpers.stale_kv_greedy, greedy decoding of each prompt alone with transformers' own cache,
the weights swapped in place at the row's mark (no engine code). `sharp_model` makes greedy tokens depend on the
context, and the new weights are a different perturbation, so tokens after the mark change."""

from __future__ import annotations

import copy

import pytest

from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.types import SamplingParams
from tests.engine_helpers import SwapAt, perturbed, stale_kv_greedy

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]
T = 10


@pytest.fixture
def model(sharp_model):
    return copy.deepcopy(sharp_model)


@pytest.fixture
def new_weights(sharp_model) -> dict:
    other = perturbed(copy.deepcopy(sharp_model), seed=7)
    return {n: p.detach().clone() for n, p in other.named_parameters()}


def _oracle(sharp_model, new, prompt, mark, min_new):
    return stale_kv_greedy(copy.deepcopy(sharp_model), new, prompt, mark, T, {EOS}, min_new)


@pytest.mark.parametrize("at, min_new", [(1, 6), (4, 6), (7, 0)])
def test_a_version_taken_mid_decode_continues_over_the_old_cache(sharp_model, model, new_weights, at, min_new):
    """One decode batch; the version lands at poll `at` (1: before the prefill, mark 0; 4: after 3 tokens). Every row
    equals the oracle swapped at its mark, token for token; a row that ended before the update is all old.
    Catches: a mark off by one (the update lands a step early or late), an update that re-prefills instead of keeping
    the cache, a poll after the step instead of before it."""
    engine = NativeEngine(model, pad_id=PAD, eos_id=EOS)
    updates = SwapAt(engine, new_weights, at)
    got = engine.generate(PROMPTS, SamplingParams(max_new_tokens=T, min_new_tokens=min_new, greedy=True), None, updates)
    (marks,) = engine.last_update_marks
    assert marks == [at - 1] * len(PROMPTS)  # poll 1 is before the batch, poll j + 1 after its token j
    changed = 0
    for prompt, c, mark in zip(PROMPTS, got, marks):
        toks, lps = _oracle(sharp_model, new_weights, prompt, mark, min_new)
        old, _ = _oracle(sharp_model, {}, prompt, 10**9, min_new)
        assert c.token_ids == toks, (mark, c.token_ids, toks, old)
        assert c.logprobs == pytest.approx(lps, abs=1e-4)
        changed += c.token_ids != old
    assert changed, "the new weights change no token: the test cannot tell an update from none"


def test_decode_batches_after_the_update_are_all_new(sharp_model, model, new_weights):
    """max_batch_size=2: the version lands in the first batch after 2 tokens; its rows are marked 2, the rows of the
    second batch 0 (every token theirs is new), and each row equals the oracle at its mark."""
    engine = NativeEngine(model, pad_id=PAD, eos_id=EOS, max_batch_size=2)
    updates = SwapAt(engine, new_weights, 3)
    got = engine.generate(PROMPTS, SamplingParams(max_new_tokens=T, min_new_tokens=6, greedy=True), None, updates)
    assert engine.last_update_marks == [[2, 2, 0, 0]]
    for prompt, c, mark in zip(PROMPTS, got, engine.last_update_marks[0]):
        toks, _ = _oracle(sharp_model, new_weights, prompt, mark, 6)
        assert c.token_ids == toks


def test_without_updates_nothing_is_marked_and_polls_change_nothing(model, new_weights):
    engine = NativeEngine(model, pad_id=PAD, eos_id=EOS)
    sp = SamplingParams(max_new_tokens=T, temperature=1.0, seed=3)
    plain = engine.generate(PROMPTS, sp)
    never = SwapAt(engine, new_weights, at=10**6)
    polled = engine.generate(PROMPTS, sp, None, never)
    assert engine.last_update_marks == [] and never.polls > 1
    assert [c.token_ids for c in polled] == [c.token_ids for c in plain]
    assert [c.logprobs for c in polled] == [c.logprobs for c in plain]
