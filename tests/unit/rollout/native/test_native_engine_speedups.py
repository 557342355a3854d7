"""What makes the native engine fast, pinned: a cache allocated once, finished rows dropped,
no host sync per token, no vocabulary sort without top-p, the fixed-shape (CUDA-graph)
step, each still exact against the trainer's logprobs.

Legend: N sequences, P prompt tokens (left-padded), T new tokens, S = P + T - 1 cache slots.
The CUDA-graph capture itself needs a GPU (tests/gpu); here its fixed-shape step runs
eagerly (`DecodeGraphs(capture=False)`), which exercises the same cache, masks and graph sizes.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from hybrid_rl.models.logprobs import build_sequences, response_logprobs
from hybrid_rl.rollout.native import decode_loop
from hybrid_rl.rollout.native import engine as native
from hybrid_rl.rollout.native.decode_graph import DecodeGraphs
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.rollout.native.kv_cache import StaticKVCache, _SlotLayer
from hybrid_rl.rollout.native.lean_step import LeanStep
from hybrid_rl.types import SamplingParams
from tests.unit.rollout.native.test_native_engine import ForceTokens as BaseForceTokens

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]
MANY = [p for p in PROMPTS for _ in range(4)]  # 16 rows, four prompt lengths


class Recorder:
    """Every step the engine runs, through the model's forward (a pre-hook) or the lean decode
    step (`LeanStep.__call__` wrapped): input shapes, the cache object and its buffer addresses."""

    def __init__(self, model):
        self.shapes, self.caches, self.ptrs, self.fed, self.lean_calls = [], [], [], [], 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)
        self.real_lean = LeanStep.__call__
        recorder = self

        def lean_call(step, ids_M1, pos_M1, attn_MS, cache):
            recorder.lean_calls += 1
            recorder.record(ids_M1, cache)
            return recorder.real_lean(step, ids_M1, pos_M1, attn_MS, cache)

        LeanStep.__call__ = lean_call

    def __call__(self, module, args, kwargs):
        self.record(kwargs["input_ids"], kwargs["past_key_values"])

    def record(self, ids, cache):
        self.shapes.append(tuple(ids.shape))
        self.caches.append(cache)
        self.ptrs.append(cache.data_ptrs())
        self.fed.append(ids[:, -1].tolist())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        LeanStep.__call__ = self.real_lean


class ForceTokens(BaseForceTokens):
    """`ban`ned tokens get logit -inf; at forward call c (0 = prefill), PROMPTS row r's logit
    `tok` is set to 1e4 for each (r, tok) in schedule[c].

    Rows are found by position, not by index, because dropped rows shift the batch: the
    PROMPTS have distinct lengths, so at call c row r is the one at position len(PROMPTS[r]) + c - 1.
    """

    def select(self, row: int, kw: dict):
        return kw["position_ids"][:, -1] == len(PROMPTS[row]) + self.calls - 1


def counting(fn, counts: dict, key: str):
    """`fn`, counting its calls in counts[key]."""

    def wrapper(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    return wrapper


def expected_batch_sizes(comps, T, every):
    """The decode batch of every forward call after the prefill, by the engine's rule: at a
    stop check (after token t, (t + 1) % every == 0) finished rows go once they are >= 1/8."""
    done_after = [len(c.token_ids) - 1 if c.finish_reason == "stop" else T for c in comps]
    live, sizes = list(range(len(comps))), []
    for t in range(T - 1):
        if (t + 1) % every == 0:
            alive = [i for i in live if done_after[i] > t]
            if not alive:
                break
            if len(live) - len(alive) >= max(1, len(live) // 8):
                live = alive
        sizes.append(len(live))
    return sizes


def assert_logprobs_match_trainer(model, prompts, comps, temperature):
    ids, attn, _, P = build_sequences(prompts, [c.token_ids for c in comps], PAD)
    with torch.no_grad():
        logp_NT, _ = response_logprobs(model, ids, attn, P, temperature)
    for i, c in enumerate(comps):
        got = torch.tensor(c.logprobs, dtype=torch.float32)
        torch.testing.assert_close(got, logp_NT[i, : len(got)], atol=1e-5, rtol=0, msg=f"row {i}")


def fixed_shape_engine(model, **kw):
    """An engine whose decode step takes the CUDA-graph path's shapes (full-length cache, full
    mask, power-of-two graph sizes), run eagerly so that it works on CPU. The step is the lean
    one, as on CUDA (the model's forward is never captured)."""
    eng = NativeEngine(model, pad_id=PAD, eos_id=EOS, **kw)
    real_path = eng._decode_path

    def graph_path(dev):
        path = real_path(dev)
        assert path.name == "lean"  # on CUDA this path would be "cuda_graph"
        return replace(path, name="cuda_graph")

    eng._decode_path = graph_path
    eng._new_graphs = lambda cache, dev, lean: DecodeGraphs(eng.model, cache, dev, capture=False, lean=lean)
    return eng


# ---------------------------------------------------------------------------- cache
def test_cache_allocated_once_at_final_size_and_never_moves(sharp_model, monkeypatch):
    inits = []
    real_init = _SlotLayer.lazy_initialization
    monkeypatch.setattr(_SlotLayer, "lazy_initialization", lambda self, k, v: (inits.append(1), real_init(self, k, v)))
    eng = NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS, stop_check_every=2)
    T = 12
    with Recorder(sharp_model) as rec:
        comps = eng.generate(MANY, SamplingParams(max_new_tokens=T, seed=4))
    cfg = sharp_model.config
    assert len(inits) == cfg.num_hidden_layers, "one allocation per layer per generate"
    assert len(set(map(id, rec.caches))) == 1 and isinstance(rec.caches[0], StaticKVCache)
    assert min(s[0] for s in rec.shapes[1:]) < len(MANY), "rows were dropped during this run"
    assert all(p == rec.ptrs[1] for p in rec.ptrs[1:]), "a cache buffer moved during decoding"
    assert len(rec.ptrs[1]) == 2 * cfg.num_hidden_layers
    # Sized S = P + T - 1 slots per row, the planner's context (plan.memory.kv_cache_bytes).
    P = max(map(len, MANY))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    expect = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * len(MANY) * (P + T - 1) * 4
    assert eng.memory_bytes()["kv_cache"] == eng.last_kv_bytes == expect
    assert any(c.finish_reason == "stop" for c in comps)


def test_keep_rows_moves_live_rows_to_the_front_in_place():
    cache = StaticKVCache(max_rows=5, max_len=6)
    k = torch.arange(5 * 2 * 4 * 3, dtype=torch.float32).reshape(5, 2, 4, 3)
    cache.update(k, -k, 0)
    cache.advance(4)
    ptr = cache.layers[0].buf_k.data_ptr()
    cache.keep_rows(torch.tensor([1, 3, 4]))
    layer = cache.layers[0]
    assert layer.keys.shape == (3, 2, 6, 3) and layer.keys.data_ptr() == ptr
    assert torch.equal(layer.keys[:, :, :4], k[[1, 3, 4]]) and torch.equal(layer.values[:, :, :4], -k[[1, 3, 4]])
    # The next write lands in slot 4 of the kept rows, and the read covers slots 0..4.
    new = torch.ones(3, 2, 1, 3)
    keys, _ = cache.update(new, new, 0)
    assert keys.shape == (3, 2, 5, 3) and torch.equal(keys[:, :, 4:], new)
    with pytest.raises(RuntimeError, match="overflow"):
        cache.advance(1)
        cache.update(torch.ones(3, 2, 2, 3), torch.ones(3, 2, 2, 3), 0)


# ---------------------------------------------------------------------------- dropping rows
@pytest.mark.parametrize("every", [1, 2, 8])
def test_finished_rows_are_dropped_from_the_decode_batch(sharp_model, every):
    T = 12
    with Recorder(sharp_model) as rec:
        comps = NativeEngine(sharp_model, PAD, EOS, stop_check_every=every).generate(
            MANY, SamplingParams(max_new_tokens=T, seed=4)
        )
    assert rec.shapes[0] == (len(PROMPTS), max(map(len, MANY))), "each distinct prompt is prefilled once"
    sizes = expected_batch_sizes(comps, T, every)
    assert [s[0] for s in rec.shapes[1:]] == sizes
    assert min(sizes) < len(MANY), "the seed should finish enough rows to drop some"


def test_a_shared_prompt_is_prefilled_once_and_its_samples_match_a_separate_prefill(sharp_model):
    """Rows of one prompt, interleaved with others: one prefill row per distinct prompt, and each
    row's greedy tokens and logprobs equal those of that prompt generated on its own."""
    order = [2, 0, 2, 1, 3, 0, 2, 1]
    prompts = [PROMPTS[i] for i in order]
    sp = SamplingParams(max_new_tokens=6, greedy=True)
    with Recorder(sharp_model) as rec:
        comps = NativeEngine(sharp_model, PAD, EOS).generate(prompts, sp)
    assert rec.shapes[0] == (4, max(map(len, PROMPTS)))
    alone = {i: NativeEngine(sharp_model, PAD, EOS).generate([PROMPTS[i]], sp)[0] for i in set(order)}
    for row, i in enumerate(order):
        assert comps[row].token_ids == alone[i].token_ids, f"row {row} (prompt {i})"
        torch.testing.assert_close(
            torch.tensor(comps[row].logprobs), torch.tensor(alone[i].logprobs), atol=1e-5, rtol=0
        )
    assert_logprobs_match_trainer(sharp_model, prompts, comps, 1.0)


def test_sampled_rows_of_a_shared_prompt_get_their_own_draws(sharp_model):
    comps = NativeEngine(sharp_model, PAD, EOS).generate([PROMPTS[0]] * 8, SamplingParams(max_new_tokens=6, seed=3))
    assert len({tuple(c.token_ids) for c in comps}) > 1, "copies of one prefill must not share their samples"
    assert_logprobs_match_trainer(sharp_model, [PROMPTS[0]] * 8, comps, 1.0)


def test_tokens_after_a_stop_are_fed_as_pad(sharp_model):
    # Row 0 stops at step 1; no check comes before step 7, so it stays in the batch until then.
    wrapped = ForceTokens(sharp_model, {1: [(0, EOS)]}, ban=[EOS])
    with Recorder(sharp_model) as rec:
        comps = NativeEngine(wrapped, PAD, EOS, stop_check_every=8).generate(
            PROMPTS, SamplingParams(max_new_tokens=10, seed=1)
        )
    fed_row0 = [f[0] for f in rec.fed[1:8]]  # decode call k feeds token k-1
    assert fed_row0[1] == EOS and fed_row0[2:] == [PAD] * 5
    assert comps[0].token_ids[-1] == EOS and len(comps[0].token_ids) == 2
    assert [s[0] for s in rec.shapes[1:]] == [4] * 7 + [3] * 2


@pytest.mark.parametrize("every", [1, 4])
def test_stop_on_the_last_token_and_on_a_check_boundary(sharp_model, every):
    T = 8
    # Row 0 stops on the last token (call T-1), row 1 on the token right before a check,
    # row 2 on the token right after it; row 3 runs to the limit.
    sched = {T - 1: [(0, EOS)], 3: [(1, EOS)], 4: [(2, EOS)]}
    comps = NativeEngine(ForceTokens(sharp_model, sched, ban=[EOS]), PAD, EOS, stop_check_every=every).generate(
        PROMPTS, SamplingParams(max_new_tokens=T, greedy=True)
    )
    assert [len(c.token_ids) for c in comps] == [T, 4, 5, T]
    assert (comps[0].finish_reason, comps[0].token_ids[-1], len(comps[0].token_ids)) == ("stop", EOS, T)
    assert (comps[1].finish_reason, len(comps[1].token_ids)) == ("stop", 4)
    assert (comps[2].finish_reason, len(comps[2].token_ids)) == ("stop", 5)
    assert comps[3].finish_reason == "length" and EOS not in comps[3].token_ids


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("top_k,top_p,temperature", [(-1, 1.0, 1.0), (4, 1.0, 0.7), (-1, 0.8, 1.0), (5, 0.9, 0.7)])
@pytest.mark.parametrize("fixed_shape", [None, "lean"])
def test_logprobs_match_trainer_with_rows_dropped(sharp_model, top_k, top_p, temperature, fixed_shape):
    """Ragged prompts, rows stopping at different steps, rows dropped mid-run (eager: exactly the
    finished ones; fixed shape, through the lean step: down to power-of-two graph sizes padded with
    finished rows)."""
    T = 12
    make = fixed_shape_engine if fixed_shape else (lambda m, **kw: NativeEngine(m, PAD, EOS, **kw))
    eng = make(sharp_model, stop_check_every=2, lean_step=fixed_shape != "forward")
    # Three common words as extra stop ids: most rows stop, at many different steps.
    sp = SamplingParams(
        max_new_tokens=T, temperature=temperature, top_k=top_k, top_p=top_p, seed=4, stop_token_ids=(4, 7, 9)
    )
    with Recorder(sharp_model) as rec:
        comps = eng.generate(MANY, sp)
    assert eng.last_decode_path == ("cuda_graph" if fixed_shape else "lean")
    # Only the prefill runs the model's forward when the step is the lean one (no module hooks).
    assert rec.lean_calls == len(rec.shapes) - 1
    lengths = [len(c.token_ids) for c in comps]
    assert len(set(lengths)) > 4
    sizes = [s[0] for s in rec.shapes[1:]]
    assert min(sizes) < len(MANY), "no row was dropped: the test would not cover compaction"
    if fixed_shape:
        assert all(s & (s - 1) == 0 for s in sizes if s != len(MANY)), f"non power-of-two graph size in {sizes}"
    assert_logprobs_match_trainer(sharp_model, MANY, comps, temperature)


def test_greedy_with_rows_dropped_equals_one_row_at_a_time(sharp_model):
    # Eager only: the forced stops need the wrapper's forward, which the fixed-shape (lean) step skips;
    # its compaction into graph sizes is covered by test_logprobs_match_trainer_with_rows_dropped.
    sp = SamplingParams(max_new_tokens=10, greedy=True)
    wrapped = ForceTokens(sharp_model, {2: [(1, EOS)], 3: [(3, EOS)]})  # two rows stop early
    batched = NativeEngine(wrapped, PAD, EOS, stop_check_every=1).generate(PROMPTS, sp)
    alone = [NativeEngine(sharp_model, PAD, EOS).generate([p], sp)[0] for p in PROMPTS]
    for i in (0, 2):
        assert batched[i].token_ids == alone[i].token_ids, f"row {i}"
        assert batched[i].logprobs == pytest.approx(alone[i].logprobs, abs=1e-5)
    assert [len(batched[i].token_ids) for i in (1, 3)] == [3, 4]


# ---------------------------------------------------------------------------- host syncs
def test_host_checks_only_every_few_tokens(sharp_model, monkeypatch):
    checks = []
    real = decode_loop.alive_rows
    monkeypatch.setattr(decode_loop, "alive_rows", lambda done: (checks.append(done.numel()), real(done))[1])
    eng = NativeEngine(ForceTokens(sharp_model, {}, ban=[EOS]), PAD, EOS, stop_check_every=8)
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=33, seed=0))
    assert len(checks) == 4  # after tokens 8, 16, 24, 32 (none after the last token)


def test_default_checks_every_8_tokens_on_cuda_and_every_token_on_cpu(sharp_model, monkeypatch):
    """On CPU a check waits for nothing, and checking every token drops finished rows at once."""
    checks = []
    real = decode_loop.alive_rows
    monkeypatch.setattr(decode_loop, "alive_rows", lambda done: (checks.append(done.numel()), real(done))[1])
    NativeEngine(ForceTokens(sharp_model, {}, ban=[EOS]), PAD, EOS).generate(PROMPTS, SamplingParams(max_new_tokens=9))
    assert len(checks) == 8
    assert [native.check_every(None, d) for d in ("cpu", "cuda")] == [1, 8]
    assert native.check_every(3, "cuda") == 3


def test_no_python_level_sync_grows_with_length(sharp_model, monkeypatch):
    """Every Tensor -> Python conversion is counted: the count must not depend on T (the
    decode loop's one sync, torch.nonzero in `_alive_rows`, is counted by the test above)."""
    counts = {"n": 0}
    for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), counts, "n"))
    eng = NativeEngine(ForceTokens(sharp_model, {}, ban=[EOS]), PAD, EOS)
    per_T = {}
    for T in (9, 41):
        counts["n"] = 0
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=T, seed=0))
        per_T[T] = counts["n"]
    assert per_T[9] == per_T[41] < 9, per_T


# ---------------------------------------------------------------------------- sampling
@pytest.mark.parametrize(
    "top_k,top_p,sorts,topks",
    [(-1, 1.0, False, False), (4, 1.0, False, True), (-1, 0.9, True, False), (4, 0.9, True, True)],
)
def test_vocabulary_sorted_only_for_top_p(sharp_model, monkeypatch, top_k, top_p, sorts, topks):
    calls = {"sort": 0, "topk": 0}
    for name in calls:  # both spellings: torch.sort(x) and x.sort()
        monkeypatch.setattr(torch, name, counting(getattr(torch, name), calls, name))
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), calls, name))
    sp = SamplingParams(max_new_tokens=6, top_k=top_k, top_p=top_p, seed=3)
    NativeEngine(sharp_model, PAD, EOS).generate(PROMPTS, sp)
    assert (calls["sort"] > 0, calls["topk"] > 0) == (sorts, topks), calls


def test_sampler_draws_from_the_softmax():
    """Softmax frequencies without filtering, top-k restricts the support, a masked (-inf)
    token is never drawn, and the logprob is always the unfiltered one."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    tok, lp = native.sample_tokens(logits, SamplingParams(), gen)
    freq = torch.bincount(tok, minlength=5).float() / len(tok)
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.012, rtol=0)
    torch.testing.assert_close(lp, logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1))
    tok2, lp2 = native.sample_tokens(logits, SamplingParams(top_k=2, temperature=0.5), gen)
    assert set(tok2.tolist()) == {0, 1}
    torch.testing.assert_close(lp2, (logits / 0.5).log_softmax(-1).gather(-1, tok2[:, None]).squeeze(-1))
    share = (tok2 == 0).float().mean().item()
    assert abs(share - torch.tensor([4.0, 2.0]).softmax(-1)[0].item()) < 0.012
    # Zero-probability entries first, last and between: never drawn.
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(20000, 1)
    assert set(native._draw(probs, gen).tolist()) == {1, 3}
    # A vocabulary of several draw blocks, the last one partial (1000 = 3 x 256 + 232).
    big = torch.full((20000, 1000), float("-inf"))
    support, values = [3, 255, 256, 700, 999], torch.tensor([1.0, 0.0, 2.0, -0.5, 0.5])
    big[:, support] = values
    tok3, lp3 = native.sample_tokens(big, SamplingParams(), gen)
    assert set(tok3.tolist()) <= set(support)
    freq3 = torch.bincount(tok3, minlength=1000)[support].float() / len(tok3)
    torch.testing.assert_close(freq3, values.softmax(-1), atol=0.012, rtol=0)
    torch.testing.assert_close(lp3, big.log_softmax(-1).gather(-1, tok3[:, None]).squeeze(-1))


# ---------------------------------------------------------------------------- CUDA graphs flag
def test_cuda_graphs_default_off_on_cpu_and_forced_on_falls_back(sharp_model):
    sp = SamplingParams(max_new_tokens=6, seed=9)
    plain = NativeEngine(sharp_model, PAD, EOS)
    ref = plain.generate(PROMPTS, sp)
    assert plain.last_graph_error is None
    forced = NativeEngine(sharp_model, PAD, EOS, cuda_graphs=True)
    with pytest.warns(UserWarning, match="cuda_graphs=True ignored"):
        got = forced.generate(PROMPTS, sp)
    assert "CUDA" in forced.last_graph_error
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]


def test_a_failed_graph_step_decodes_its_batch_again_through_the_lean_step(sharp_model):
    """Catches a fallback inside the token loop: a graph step that fails at the third token drops its
    graphs and the batch is decoded again from its prefill through the lean step (a third prefill for two
    batches), so every token and logprob equals a lean rollout's exactly; the next batch tries no graphs,
    and neither does a later rollout on this engine."""
    made = []

    class FailsAtThirdToken(DecodeGraphs):
        steps, closed = 0, False

        def step(self, *args):
            FailsAtThirdToken.steps += 1
            if FailsAtThirdToken.steps == 3:
                raise RuntimeError("capture failed")
            return super().step(*args)

        def close(self):  # the graphs (and their pool) are dropped before anything decodes on
            FailsAtThirdToken.closed = True
            super().close()

    sp = SamplingParams(max_new_tokens=7, seed=5)
    ref = NativeEngine(sharp_model, PAD, EOS, max_batch_size=2).generate(PROMPTS, sp)
    eng = fixed_shape_engine(sharp_model, max_batch_size=2)
    eng._new_graphs = lambda cache, dev, lean: (
        made.append(1) or FailsAtThirdToken(eng.model, cache, dev, capture=False, lean=lean)
    )
    with Recorder(sharp_model) as rec, pytest.warns(UserWarning, match="decoding eagerly"):
        got = eng.generate(PROMPTS, sp)
    assert "capture failed" in eng.last_graph_error and FailsAtThirdToken.closed
    assert eng.last_decode_path == "lean" and made == [1]
    assert len(rec.shapes) - rec.lean_calls == 3, "prefills: batch 1, batch 1 again, batch 2"
    assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in ref]
    del eng._decode_path
    assert eng._decode_path(torch.device("cuda")).name == "lean", "a capture that failed is not tried again"


def test_bad_stop_check_every_raises(sharp_model):
    with pytest.raises(ValueError, match="stop_check_every"):
        NativeEngine(sharp_model, PAD, EOS, stop_check_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NativeEngine(sharp_model, PAD, EOS, stop_check_every=1)
