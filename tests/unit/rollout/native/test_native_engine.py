"""NativeEngine (KV-cache decoding on a plain, unsharded module) vs full forward passes.

Legend: N sequences, P prompt tokens (left-padded), T response tokens, V vocab.

The session tiny model has near-uniform logits (init std 0.02), so its greedy
output is one token repeated. `sharp_model` adds seeded noise to every weight
matrix: its predictions depend on the context, which makes "greedy == argmax of
a full forward" and "engine logprobs == trainer logprobs" real checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_rl.models.logprobs import build_sequences, position_ids, response_logprobs
from hybrid_rl.rollout.base import engine_class
from hybrid_rl.rollout.native.engine import NativeEngine, filter_logits
from hybrid_rl.rollout.native.lean_step import LeanStep
from hybrid_rl.types import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
# "1 2 3 =", "4 =", "7 8 9 0 1 2 =", "5 5 =" in the tiny vocabulary: four different prompt lengths.
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]


@pytest.fixture
def engine(sharp_model):
    return NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS)


def _full_logits(model, prompts, responses):
    """Logits at the positions that predict each response token: (N, T, V), one full forward, no cache."""
    ids, attn, _, P = build_sequences(prompts, responses, PAD)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False).logits
    T = ids.shape[1] - P
    return logits[:, P - 1 : P - 1 + T].float()


class ForceTokens(torch.nn.Module):
    """Wraps a causal LM: the `ban`ned tokens get logit -inf at every call, then at forward call c
    (0 = prefill) logit `tok` of row `row` is set to 1e4 for each (row, tok) in schedule[c].

    `row` is the batch position at that call: the engine drops finished rows only at its stop
    checks (every 8 tokens by default), so the schedules here stay before the first check or
    stop every row at once (tests/unit/rollout/native/test_native_engine_speedups.py finds rows by position)."""

    def __init__(self, inner, schedule, ban=()):
        super().__init__()
        self.inner, self.schedule, self.ban, self.calls = inner, schedule, list(ban), 0

    def select(self, row: int, kw: dict):
        """The batch index (or mask) of schedule row `row` at this call."""
        return row

    def forward(self, **kw):
        out = self.inner(**kw)
        if self.ban:
            out.logits[..., self.ban] = float("-inf")
        for row, tok in self.schedule.get(self.calls, []):
            out.logits[self.select(row, kw), -1, tok] = 1e4
        self.calls += 1
        return out


# ---------------------------------------------------------------------------- greedy
def test_greedy_equals_full_forward_argmax(engine, sharp_model):
    comps = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, greedy=True))
    assert len(comps) == len(PROMPTS), "one completion per prompt"
    responses = [c.token_ids for c in comps]
    assert len({tuple(r) for r in responses}) > 1, "degenerate model: every prompt gives the same output"
    assert any(len(set(r)) > 1 for r in responses), "degenerate model: only repeated tokens"
    argmax = _full_logits(sharp_model, PROMPTS, responses).argmax(-1)
    for i, c in enumerate(comps):
        assert c.token_ids == argmax[i, : len(c.token_ids)].tolist(), f"row {i}"
        if c.finish_reason == "length":
            assert len(c.token_ids) == 10 and EOS not in c.token_ids
        else:
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]


@pytest.mark.parametrize("free", [None, 1 << 34])
def test_no_prompts_give_no_completions(sharp_model, free):
    # A rank with no rows this round (two ranks validating three prompts) still calls generate; with the
    # memory-sized batch it computed a batch of 0 rows (range step 0).
    eng = NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS, free_memory=lambda dev: free)
    assert eng.generate([], SamplingParams(max_new_tokens=4, seed=0)) == []


def test_greedy_batch_equals_one_prompt_at_a_time(engine):
    """Left padding and batching must not change any row's result."""
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    batched = engine.generate(PROMPTS, sp)
    for i, p in enumerate(PROMPTS):
        alone = engine.generate([p], sp)[0]
        assert alone.token_ids == batched[i].token_ids, f"row {i}"
        assert alone.finish_reason == batched[i].finish_reason
        assert alone.logprobs == pytest.approx(batched[i].logprobs, abs=1e-5)


def test_top_k_1_equals_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, greedy=True, temperature=0.7))
    top1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=1, temperature=0.7, seed=5))
    assert [c.token_ids for c in top1] == [c.token_ids for c in greedy]
    for a, b in zip(top1, greedy):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


# ---------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("top_k", [-1, 4])
def test_engine_logprobs_match_trainer_recompute(engine, sharp_model, temperature, top_k):
    """Engine logprobs are log_softmax(logits / T) of the sampled token, before top-k (SGLang's convention)."""
    prompts = [p for p in PROMPTS for _ in range(3)]
    comps = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k, seed=11))
    lengths = [len(c.token_ids) for c in comps]
    assert len(set(lengths)) > 1 and max(lengths) > 3  # ragged responses and ragged prompts in one batch
    ids, attn, _, P = build_sequences(prompts, [c.token_ids for c in comps], PAD)
    with torch.no_grad():
        logp_NT, _ = response_logprobs(sharp_model, ids, attn, P, temperature)
    for i, c in enumerate(comps):
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        got = torch.tensor(c.logprobs, dtype=torch.float32)
        torch.testing.assert_close(got, logp_NT[i, : len(got)], atol=1e-5, rtol=0, msg=f"row {i}")
        if top_k > 0:  # every sampled token lies in the top-k of its position
            logits = _full_logits(sharp_model, [prompts[i]], [c.token_ids])[0]
            kth = logits.topk(top_k, dim=-1).values[:, -1]
            assert (logits.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1) >= kth).all()


# ---------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("lean", [False, True])
def test_kv_cache_one_token_per_decode_call(sharp_model, monkeypatch, lean):
    """Through the model's forward or the lean decode step (which gets the cache directly)."""
    calls = []

    def record(module, args, kwargs):
        calls.append((tuple(kwargs["input_ids"].shape), kwargs.get("past_key_values"), kwargs.get("use_cache")))

    real_lean = LeanStep.__call__

    def record_lean(step, ids, pos, attn, cache):
        calls.append((tuple(ids.shape), cache, True))
        return real_lean(step, ids, pos, attn, cache)

    monkeypatch.setattr(LeanStep, "__call__", record_lean)
    handle = sharp_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        # Stop checks after every token: the loop ends, and finished rows leave the batch, at once.
        eng = NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS, stop_check_every=1, lean_step=lean)
        max_new = 9
        comps = eng.generate(
            PROMPTS, SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=1, stop_token_ids=(7, 9))
        )
    finally:
        handle.remove()
    assert eng.last_decode_path == ("lean" if lean else "forward")
    lengths = [len(c.token_ids) for c in comps]
    longest = max(lengths)
    N, P = len(PROMPTS), max(len(p) for p in PROMPTS)
    # Prefill + one call per further token: exactly `longest` forward calls, never more than max_new_tokens.
    assert len(calls) == longest <= max_new
    assert len(set(lengths)) > 1, "the seed should give ragged lengths"
    assert calls[0][0] == (N, P)
    # Decode call k feeds token k-1 of the rows that have not stopped by then (length > k).
    assert [c[0] for c in calls[1:]] == [(sum(n > k for n in lengths), 1) for k in range(1, longest)]
    cache = calls[0][1]
    assert cache is not None and all(c[1] is cache for c in calls) and all(c[2] for c in calls)
    assert eng.last_kv_bytes > 0


@pytest.mark.parametrize("every", [1, 3, 8])
def test_forward_calls_stop_early_when_all_rows_stop(sharp_model, every):
    wrapped = ForceTokens(sharp_model, {2: [(r, EOS) for r in range(len(PROMPTS))]}, ban=[EOS])
    eng = NativeEngine(wrapped, pad_id=PAD, eos_id=EOS, stop_check_every=every)
    comps = eng.generate(PROMPTS, SamplingParams(max_new_tokens=16, greedy=True))
    # EOS at step 2 in every row ends the loop at the first stop check after it (after token
    # `every * ceil(3 / every)`): prefill + one decode call per token before that check.
    assert wrapped.calls == every * math.ceil(3 / every)
    assert all(c.finish_reason == "stop" and len(c.token_ids) == 3 and c.token_ids[-1] == EOS for c in comps)


# ---------------------------------------------------------------------------- seeds
def test_seeded_sampling_is_reproducible(engine):
    prompts = [p for p in PROMPTS for _ in range(4)]
    a = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=7))
    b = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=7))
    c = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=8))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # Samples of one prompt differ from each other (the generator advances per row, not per prompt).
    assert len({tuple(x.token_ids) for x in a[:4]}) > 1


# ---------------------------------------------------------------------------- stopping
def test_stop_on_eos(sharp_model):
    # EOS is banned except where forced: row 0 at step 3, row 2 at step 5; rows 1 and 3 run to the limit.
    sp = SamplingParams(max_new_tokens=10, greedy=True)
    plain = NativeEngine(ForceTokens(sharp_model, {}, ban=[EOS]), pad_id=PAD, eos_id=EOS).generate(PROMPTS, sp)
    # Checks every 8 tokens: the schedule's rows are batch positions, which no drop moves before then.
    eng = NativeEngine(
        ForceTokens(sharp_model, {3: [(0, EOS)], 5: [(2, EOS)]}, ban=[EOS]), pad_id=PAD, eos_id=EOS, stop_check_every=8
    )
    comps = eng.generate(PROMPTS, sp)
    for row, step in ((0, 3), (2, 5)):
        c = comps[row]
        assert c.finish_reason == "stop"
        assert c.token_ids == plain[row].token_ids[:step] + [EOS]
        assert len(c.logprobs) == step + 1
        assert c.logprobs[-1] == pytest.approx(0.0, abs=1e-4)  # the forced EOS has probability ~1
        assert c.logprobs[:-1] == pytest.approx(plain[row].logprobs[:step], abs=1e-5)
    for row in (1, 3):  # a neighbour stopping does not change the other rows
        assert comps[row].token_ids == plain[row].token_ids
        assert comps[row].finish_reason == "length" and len(comps[row].token_ids) == 10


def test_natural_eos_ends_completion(sharp_model):
    """Without any forcing, a sampled EOS is the last token and only EOS/stop ids end a row early."""
    comps = NativeEngine(sharp_model, PAD, EOS).generate(
        [p for p in PROMPTS for _ in range(4)], SamplingParams(max_new_tokens=12, seed=4)
    )
    stopped = [c for c in comps if c.finish_reason == "stop"]
    assert stopped and len(stopped) < len(comps)
    for c in comps:
        assert EOS not in c.token_ids[:-1]
        assert (c.token_ids[-1] == EOS) == (c.finish_reason == "stop")
        if c.finish_reason == "length":
            assert len(c.token_ids) == 12


def test_stop_on_extra_stop_token(sharp_model):
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    # EOS is banned throughout so that no row stops on its own.
    plain = NativeEngine(ForceTokens(sharp_model, {}, ban=[EOS]), pad_id=PAD, eos_id=EOS).generate(PROMPTS, sp)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in plain)
    heads = [c.token_ids[:2] for c in plain]
    # A word no row produces in its first two steps: an ordinary token unless listed as a stop id.
    STOP = next(t for t in range(4, 15) if all(t not in h for h in heads))
    sched = {2: [(r, STOP) for r in range(len(PROMPTS))]}
    go_on = NativeEngine(ForceTokens(sharp_model, sched, ban=[EOS]), pad_id=PAD, eos_id=EOS).generate(PROMPTS, sp)
    stop = NativeEngine(ForceTokens(sharp_model, sched, ban=[EOS]), pad_id=PAD, eos_id=EOS).generate(
        PROMPTS, SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=(STOP,))
    )
    for i, head in enumerate(heads):
        assert stop[i].token_ids == head + [STOP] and stop[i].finish_reason == "stop", f"row {i}"
        # Without the extra stop id the forced token is just a token: decoding goes on to the limit.
        assert go_on[i].token_ids[:3] == head + [STOP]
        assert go_on[i].finish_reason == "length" and len(go_on[i].token_ids) == 8


def test_max_new_tokens_respected(sharp_model):
    # No EOS can be chosen: it gets -inf at every step, so every row runs to the limit.
    eng = NativeEngine(ForceTokens(sharp_model, {}, ban=[EOS]), pad_id=PAD, eos_id=EOS)
    for max_new in (1, 5):
        comps = eng.generate(PROMPTS * 2, SamplingParams(max_new_tokens=max_new, seed=3))
        for c in comps:
            assert len(c.token_ids) == len(c.logprobs) == max_new
            assert c.finish_reason == "length" and EOS not in c.token_ids


def test_max_batch_size_splits_without_changing_greedy_output(sharp_model):
    sp = SamplingParams(max_new_tokens=6, greedy=True)
    whole = NativeEngine(sharp_model, PAD, EOS).generate(PROMPTS, sp)
    split = NativeEngine(sharp_model, PAD, EOS, max_batch_size=3).generate(PROMPTS, sp)
    assert [c.token_ids for c in split] == [c.token_ids for c in whole]


# ---------------------------------------------------------------------------- filter_logits
def _naive_filter(row, top_k, top_p):
    """One row of Python floats -> the set of kept indices (top-k first, then the nucleus of what is left)."""
    V = len(row)
    keep = set(range(V))
    if 0 < top_k < V:
        kth = sorted(row, reverse=True)[top_k - 1]
        keep = {j for j in keep if row[j] >= kth}
    if top_p < 1.0:
        m = max(row[j] for j in keep)
        z = sum(math.exp(row[j] - m) for j in keep)
        order = sorted(keep, key=lambda j: -row[j])
        mass, nucleus = 0.0, set()
        for j in order:
            if mass >= top_p:  # mass strictly before j already reaches top_p
                break
            nucleus.add(j)
            mass += math.exp(row[j] - m) / z
        keep = nucleus
    return keep


@pytest.mark.parametrize(
    "top_k,top_p", [(1, 1.0), (5, 1.0), (40, 1.0), (-1, 0.5), (-1, 0.9), (-1, 0.01), (10, 0.8), (3, 0.3)]
)
def test_filter_logits_matches_naive_loop(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100))
    logits = torch.randn(16, 40, generator=g, dtype=torch.float64) * 2
    out = filter_logits(logits, top_k, top_p)
    assert out.shape == logits.shape
    for i, row in enumerate(logits.tolist()):
        keep = _naive_filter(row, top_k, top_p)
        assert len(keep) >= 1
        got = {j for j in range(40) if out[i, j] != float("-inf")}
        assert got == keep, f"row {i}"
        for j in keep:  # kept logits are unchanged
            assert out[i, j].item() == row[j]


def test_filter_logits_off_is_identity():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(filter_logits(logits, -1, 1.0), logits)
    assert torch.equal(filter_logits(logits, 11, 1.0), logits)  # k >= V keeps everything


# ---------------------------------------------------------------------------- memory tags, registry
def test_release_kv_cache_then_generate_raises_and_resume_restores(engine):
    sp = SamplingParams(max_new_tokens=4, greedy=True)
    before = engine.generate(PROMPTS, sp)
    engine.release(["kv_cache"])
    with pytest.raises(RuntimeError, match="resume"):
        engine.generate(PROMPTS, sp)
    engine.resume(["kv_cache"])
    after = engine.generate(PROMPTS, sp)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


def test_release_weights_on_unsharded_model_is_a_noop(engine):
    sp = SamplingParams(max_new_tokens=4, greedy=True)
    before = engine.generate(PROMPTS, sp)
    engine.release(["weights"])
    engine.resume(["weights"])
    assert [c.token_ids for c in engine.generate(PROMPTS, sp)] == [c.token_ids for c in before]


@pytest.mark.parametrize("call", ["release", "resume"])
def test_bad_memory_tag_raises(engine, call):
    with pytest.raises(ValueError, match="kv_cach"):
        getattr(engine, call)(["kv_cach"])
    with pytest.raises(ValueError, match="weights"):  # the message lists the valid tags
        getattr(engine, call)(["weights", "optimizer"])


def test_empty_prompt_raises(engine):
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[5, 14], []], SamplingParams(max_new_tokens=2))


def test_engine_class_lookup():
    assert engine_class("native") is NativeEngine
    with pytest.raises(ValueError, match="native") as err:
        engine_class("nope")
    assert "nope" in str(err.value)


@pytest.mark.parametrize("kw", [dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params_raise(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_update_weights_copies_into_engine_model(tiny_model, sharp_model):
    eng = NativeEngine(tiny_model, PAD, EOS)
    eng.update_weights(sharp_model.named_parameters())
    for (n, a), (_, b) in zip(tiny_model.named_parameters(), sharp_model.named_parameters()):
        assert torch.equal(a, b), n
    with pytest.raises(KeyError, match="nope"):
        eng.update_weights([("nope", torch.zeros(1))])


def test_prompt_constants_match_the_tiny_tokenizer(tiny_tokenizer):
    assert (tiny_tokenizer.pad_token_id, tiny_tokenizer.eos_token_id) == (PAD, EOS)
    texts = ["1 2 3 =", "4 =", "7 8 9 0 1 2 =", "5 5 ="]
    assert [tiny_tokenizer(t, add_special_tokens=False).input_ids for t in texts] == PROMPTS
