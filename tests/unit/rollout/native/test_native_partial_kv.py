"""rollout.partial_kv=keep on the native engine (types.PartialRequest.keep_kv / kv): a row the early stop cuts gives
back the keys and values of every token it fed (`last_kept_kv`), and a later call continues it over them instead of
recomputing its prompt and prefix, under whatever weights the engine holds by then.

Oracle: tests/engine_helpers.stale_kv_greedy, greedy decoding of each prompt alone with transformers' own cache, the
weights swapped in place once the row holds `mark` tokens, the cache the old weights wrote kept (no engine code): a
row cut after k tokens and continued over its kept cache under new weights is exactly that run with mark = k.
`sharp_model` makes greedy tokens depend on the context, and the new weights are another perturbation, so the
continuation differs from both an all-old run and a recomputed prefix."""

from __future__ import annotations

import copy

import pytest
import torch

from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.types import PartialRequest, SamplingParams
from tests.engine_helpers import perturbed, stale_kv_greedy

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14], [10, 3, 14]]
T, CUT = 10, 3


@pytest.fixture
def new_weights(sharp_model) -> dict:
    other = perturbed(copy.deepcopy(sharp_model), seed=7)
    return {n: p.detach().clone() for n, p in other.named_parameters()}


def _greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=T, min_new_tokens=T, greedy=True)


def _oracle(sharp_model, new, prompt, mark):
    return stale_kv_greedy(copy.deepcopy(sharp_model), new, prompt, mark, T, {EOS}, min_new=T)


def _swap(engine: NativeEngine, new: dict) -> None:
    engine.begin_weight_update()
    engine.update_weights(list(new.items()))


def _cut_rows(engine: NativeEngine):
    """Row 0 ends after 1 token and leaves the batch (the cache is compacted), row 1 at CUT tokens (their budgets);
    the other three may not stop before T (min_new_tokens): the early stop (2 groups needed) cuts them after CUT
    tokens, with keep_kv."""
    hi, lo = (1, CUT, T, T, T), (0, 0, T, T, T)
    first = engine.generate(PROMPTS, _greedy(), PartialRequest(hi, lo, (0, 1, 2, 3, 4), 2, keep_kv=True))
    assert [c.finish_reason for c in first] == ["length", "length", "abort", "abort", "abort"]
    assert [len(c.token_ids) for c in first] == [1] + [CUT] * 4
    return first, list(engine.last_kept_kv)


@pytest.mark.parametrize("max_batch_size", [0, 2])
def test_a_kept_row_continues_over_the_cache_the_old_weights_wrote(sharp_model, new_weights, max_batch_size):
    """Three rows cut after CUT tokens with keep_kv, then continued under new weights with their kept keys and values
    beside a fresh row (one decode batch, and batches of 2: a fresh and a kept row, then two kept rows): each
    kept row equals the oracle swapped at mark CUT, token for token, the fresh row the new weights' own run.
    Catches: kept keys written one slot off, the last token at the wrong position or not fed, a mask that misses a
    kept slot or reads an unwritten one, kept rows read at their original index after a compaction, kept rows
    recomputed (the test requires a token that tells them apart)."""
    first, kept = _cut_rows(NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS))
    assert kept[0] is None and kept[1] is None
    for i in (2, 3, 4):  # every token the row fed: its prompt and all its tokens but the last
        assert kept[i].shape[3] == len(PROMPTS[i]) + CUT - 1 and kept[i].device.type == "cpu"
    engine = NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS, max_batch_size=max_batch_size)
    _swap(engine, new_weights)
    rows = [PROMPTS[0]] + [PROMPTS[i] + first[i].token_ids for i in (2, 3, 4)]
    request = PartialRequest((T,) + (T - CUT,) * 3, (T,) + (T - CUT,) * 3, (0, 1, 2, 3), 4, kv=(None, *kept[2:]))
    got = engine.generate(rows, _greedy(), request)
    fresh, _ = _oracle(sharp_model, new_weights, PROMPTS[0], 0)
    assert got[0].token_ids == fresh
    differs = 0
    for i, c in zip((2, 3, 4), got[1:]):
        toks, lps = _oracle(sharp_model, new_weights, PROMPTS[i], CUT)
        assert first[i].token_ids + c.token_ids == toks, i
        assert c.logprobs == pytest.approx(lps[CUT:], abs=1e-4)
        recomputed, _ = _oracle(sharp_model, new_weights, PROMPTS[i] + first[i].token_ids, 0)
        differs += c.token_ids != recomputed[: T - CUT]
    assert differs, "the kept cache and a recomputed one give the same tokens: the test cannot tell them apart"


def test_without_keep_kv_nothing_is_kept_and_kept_rows_under_the_same_weights_equal_the_uninterrupted_run(sharp_model):
    """keep_kv off: last_kept_kv all None. Kept and continued under unchanged weights: prefix + continuation is the
    uninterrupted run (the property rollout.partial promises, here without recomputing)."""
    engine = NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS)
    hi, lo = (1, CUT, T, T, T), (0, 0, T, T, T)
    engine.generate(PROMPTS, _greedy(), PartialRequest(hi, lo, (0, 1, 2, 3, 4), 2))
    assert engine.last_kept_kv == [None] * len(PROMPTS)
    ref = engine.generate(PROMPTS, _greedy())
    first, kept = _cut_rows(engine)
    rows = [PROMPTS[i] + first[i].token_ids for i in (2, 3, 4)]
    got = engine.generate(rows, _greedy(), PartialRequest((T - CUT,) * 3, (T - CUT,) * 3, (0, 1, 2), 3, kv=kept[2:]))
    for i, c in zip((2, 3, 4), got):
        assert first[i].token_ids + c.token_ids == ref[i].token_ids
        assert first[i].logprobs + c.logprobs == pytest.approx(ref[i].logprobs, abs=1e-5)


def test_kept_keys_and_values_that_do_not_fit_the_row_are_refused(sharp_model):
    engine = NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS)
    first, kept = _cut_rows(engine)
    row = PROMPTS[2] + first[2].token_ids[:-1]  # one token short: the kept cache covers a token the row lacks
    with pytest.raises(ValueError, match=r"kv\[0\].*last_kept_kv"):
        engine.generate([row], _greedy(), PartialRequest((T,), (0,), (0,), 1, kv=(kept[2],)))
    row = PROMPTS[2] + first[2].token_ids
    with pytest.raises(ValueError, match=r"kv\[0\]: shape \(1, 2,.*not \(2, 2,"):  # another model's: one layer
        engine.generate([row], _greedy(), PartialRequest((T,), (0,), (0,), 1, kv=(kept[2][:1],)))
    with pytest.raises(ValueError, match="kv, when given"):
        PartialRequest((T, T), (0, 0), (0, 1), 2, kv=(kept[2],))


def test_kept_keys_are_a_copy_on_the_host(sharp_model):
    """The engine's cache goes back with the rollout: a kept row must not be a view of it."""
    engine = NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS)
    _, kept = _cut_rows(engine)
    before = kept[2].clone()
    engine.generate(PROMPTS, _greedy())  # a new call's cache: were kept a view of the old one, it could change
    assert torch.equal(kept[2], before) and kept[2].is_contiguous()


def test_a_kept_row_longer_than_the_fresh_rows_shifts_them_right_not_apart(sharp_model):
    """A kept row sets the prompt slots P (its cache + its last token); the fresh rows then end at slot P - 1 too
    (more left padding), so no row has a gap before its first fed-back token: varlen attention (flash-attention,
    which reads a 2-D mask as left padding) could not read one. Catches: fresh rows left where their own plan ends."""
    engine = NativeEngine(copy.deepcopy(sharp_model), pad_id=PAD, eos_id=EOS)
    first, kept = _cut_rows(engine)
    rows = [PROMPTS[1], PROMPTS[0], PROMPTS[2] + first[2].token_ids]
    with torch.inference_mode():
        batch = engine._prefill_batch(rows, T, torch.device("cpu"), len(rows), [None, None, kept[2]])
    P = batch.P
    assert P == len(rows[2])
    for i, row in enumerate(rows):
        real = torch.nonzero(batch.attn_NS[i, :P]).squeeze(1).tolist()
        assert real == list(range(P - len(row), P)), i  # contiguous, ending at the last prompt slot
        assert int(batch.pos_N1[i]) == len(row)
