"""Partial rollouts through the SGLang adapter (issue 37; hybrid_rl/rollout/sglang/partial.py) against the stand-in.

The stand-in streams and aborts as SGLang 0.5.21 does (sglang-api.md section 10): a request aborted while it runs
samples one more token and comes back {"type": "abort"} with every token it has. Expected tokens come from the
adapter's own uninterrupted greedy call (the non-partial path, itself pinned to the native engine by
test_sglang_engine.py's greedy test), and the stop rule's from `types.groups_complete`.

Legend: k tokens cut from an uninterrupted answer, B a row's budget.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tests.engine_helpers import perturbed as _perturbed

pytestmark = pytest.mark.usefixtures("torch_one_thread", "fake_sglang")

SHORT = [[8, 14], [4, 14]]  # greedy answers that run past 2 tokens
LONG = [[9, 10, 14], [11, 12, 13, 4, 5, 6, 14]]  # greedy answers with no stop in their first 15 tokens
STEP_DELAY_S = 0.05  # the stand-in's seconds per streamed token: an abort lands long before a long row ends


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """A policy, an SGLang engine and the phase switch over them (as test_sglang_engine.py's)."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
    from hybrid_rl.switch.phases import PhaseManager

    tok = load_tokenizer(tiny_model_dir)
    policy = _perturbed(load_causal_lm(tiny_model_dir), seed=1)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    engine = SGLangEngine(policy, tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=1)
    pm = PhaseManager(policy, opt, engine, torch.device("cpu"), bucket_bytes=64 << 10)
    yield policy, engine, pm
    engine.shutdown()


def _greedy(max_new_tokens: int):
    from hybrid_rl.types import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, greedy=True)


def _request(budgets, group_of, groups_needed, mins=None):
    from hybrid_rl.types import PartialRequest

    mins = mins or [0] * len(budgets)
    return PartialRequest(tuple(budgets), tuple(mins), tuple(group_of), groups_needed)


def _in_rollout(pm, fn):
    """fn(engine) with the engine resumed and synced, then back to TRAIN (a release: fatal if requests still run)."""
    with pm.rollout() as engine:
        out = fn(engine)
    with pm.train():
        pass
    return out


class _StepDelay:
    def __init__(self, engine):
        self.sglang = engine.engine

    def __enter__(self):
        self.sglang._debug_step_delay(STEP_DELAY_S)

    def __exit__(self, *exc):
        self.sglang._debug_step_delay(0.0)


def test_greedy_continuation_from_a_cut_prefix_equals_the_uninterrupted_answer(setup):
    """Rows cut after k tokens (k = 0 for one) and continued from prompt + prefix with budget 12 - k, in one partial
    call that needs every group, give the uninterrupted greedy 12 tokens, finish reasons and log-probs.
    Catches: a row's budget off by one or ignored (the whole 12 again), min/max per row swapped across rows."""
    _, engine, pm = setup
    prompts = [[5, 6, 7, 14], [8, 14], [4, 14], [9, 10, 14]]

    def run(e):
        full = e.generate(prompts, _greedy(12))
        cuts = [0, 5, min(3, len(full[2].token_ids) - 1), 11]
        starts = [p + c.token_ids[:k] for p, c, k in zip(prompts, full, cuts)]
        request = _request([12 - k for k in cuts], group_of=[0, 1, 2, 3], groups_needed=4)
        return full, cuts, e.generate(starts, _greedy(12), request), e.last_tail_s, e.last_generated_tokens

    full, cuts, rest, tail_s, generated = _in_rollout(pm, run)
    assert [c.finish_reason for c in full] == ["length", "length", "stop", "length"], "the rows need both endings"
    for c, k, r in zip(full, cuts, rest):
        assert c.token_ids[:k] + r.token_ids == c.token_ids
        assert r.finish_reason == c.finish_reason
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(c.logprobs[k:]), atol=1e-5, rtol=0)
    assert generated == sum(len(r.token_ids) for r in rest)
    assert tail_s is not None and tail_s >= 0.0


def test_early_stop_returns_the_finished_group_whole_and_the_rest_aborted_with_their_prefixes(setup):
    """Two groups of two rows, interleaved: group 0 with budget 2, group 1 with budget 40; groups_needed=1. Group 0
    comes back whole; group 1's rows come back "abort" holding the uninterrupted greedy prefix they reached (the
    token SGLang samples after an abort included) and its log-probs. The engine is idle afterwards: the release
    after it (a crash on SGLang if requests still ran), a flush and the next call all work.
    Catches: aborted rows returned without their tokens, the finished group aborted instead of the other, no abort
    (group 1 runs to 40), a stream left undrained (the release crashes)."""
    _, engine, pm = setup
    prompts = [LONG[0], SHORT[0], LONG[1], SHORT[1]]
    group_of = [1, 0, 1, 0]

    def run(e):
        full = e.generate(prompts, _greedy(40))
        with _StepDelay(e):
            got = e.generate(prompts, _greedy(40), _request([40, 2, 40, 2], group_of, groups_needed=1))
        return full, got, e.generate(prompts, _greedy(40))

    full, got, again = _in_rollout(pm, run)
    for i in (0, 2):
        assert 1 not in full[i].token_ids[:15], "the long rows must not stop early by themselves"
    for i, c in enumerate(got):
        n = len(c.token_ids)
        assert c.token_ids == full[i].token_ids[:n]
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(full[i].logprobs[:n]), atol=1e-5, rtol=0)
        if group_of[i] == 0:
            assert (c.finish_reason, n) == ("length", 2)
        else:
            assert c.finish_reason == "abort" and 3 <= n < 40, (c.finish_reason, n)
    assert engine.engine.tokenizer_manager.rid_to_state == {}, "no request left in flight"
    assert engine.engine.flush_cache().success
    assert [c.token_ids for c in again] == [c.token_ids for c in full]
    assert engine.last_tail_s is None, "the non-partial path measures no tail"


def test_the_owner_stops_each_ranks_rows_by_that_ranks_own_request(setup):
    """The owner of a TP group runs every rank's rows in one call (`_generate_for_group`, here with three ranks'
    requests in one process): rank 0 needs one of its two groups, rank 1 sent no PartialRequest, rank 2 needs no
    group. Rank 0's long row is aborted, rank 1's identical long row runs to its budget, rank 2's row never starts;
    each rank gets its own rows, and the one tail of the call.
    Catches: a rank's rows stopped by another rank's groups, rows scattered to the wrong rank."""
    _, engine, pm = setup
    params = _greedy(30)

    def run(e):
        full = e.generate([LONG[0], SHORT[0]], params)
        with _StepDelay(e):
            replies = e._generate_for_group(
                [
                    ([LONG[0], SHORT[0]], params, _request([30, 2], [0, 1], groups_needed=1)),
                    ([LONG[0]], params, None),
                    ([SHORT[1]], params, _request([30], [0], groups_needed=0)),
                ]
            )
        return full, replies

    full, replies = _in_rollout(pm, run)
    (rank0, tail0), (rank1, tail1), (rank2, tail2) = replies
    assert [c.finish_reason for c in rank0] == ["abort", "length"]
    assert rank0[0].token_ids == full[0].token_ids[: len(rank0[0].token_ids)] and len(rank0[0].token_ids) < 30
    assert rank0[1].token_ids == full[1].token_ids[:2]
    assert [(c.token_ids, c.finish_reason) for c in rank1] == [(full[0].token_ids, "length")]
    assert [(c.token_ids, c.logprobs, c.finish_reason) for c in rank2] == [([], [], "abort")]
    assert tail0 == tail1 == tail2 > 0.0


def test_a_request_that_needs_no_group_never_reaches_sglang(setup):
    """groups_needed=0: every row comes back unstarted ("abort", no tokens) and SGLang is not called.
    Catches: rows sent although the rule holds before the first token (they would run to their ends)."""
    _, engine, pm = setup
    calls = []

    def run(e):
        real = e.engine.generate
        e.engine.generate = lambda **kw: calls.append(kw) or real(**kw)
        try:
            return e.generate(SHORT, _greedy(4), _request([4, 4], [0, 1], groups_needed=0))
        finally:
            e.engine.generate = real

    got = _in_rollout(pm, run)
    assert [(c.token_ids, c.finish_reason) for c in got] == [([], "abort"), ([], "abort")] and calls == []


def test_a_request_that_does_not_fit_its_prompts_is_refused(setup):
    """A PartialRequest with a row count other than the prompts', or a budget above params.max_new_tokens, is a
    ValueError naming it, before SGLang sees anything.
    Catches: extra rows ignored and a budget beyond max_new_tokens decoded (both silent without the check)."""
    _, engine, pm = setup
    cases = [
        ([4, 4, 4], 4, "3 rows for 2 prompts"),
        ([4], 4, "1 rows for 2 prompts"),
        ([4, 5], 4, "budget 5 exceeds SamplingParams.max_new_tokens=4"),
    ]

    def run(e):
        for budgets, max_new, match in cases:
            request = _request(budgets, list(range(len(budgets))), groups_needed=1)
            with pytest.raises(ValueError, match=match):
                e.generate(SHORT, _greedy(max_new), request)
        return e.generate(SHORT, _greedy(4), _request([4, 4], [0, 1], groups_needed=2))

    assert [c.finish_reason for c in _in_rollout(pm, run)] == ["length", "length"], "the engine still works"


def test_a_continued_sample_reuses_the_prefix_cache_but_never_kv_from_before_a_sync(setup):
    """Under unchanged weights SGLang's radix cache serves the prompt + prefix of a continued row (cached_tokens);
    after a full weight sync (end_weight_update flushes) nothing is served, so no stale KV is reused (the stand-in
    counts hits on KV computed before a weight update: stale_cache_hits).
    Catches: the flush after a sync dropped (a continued sample would decode on stale KV)."""
    policy, engine, pm = setup
    from hybrid_rl.models.lora import base_named_parameters

    prompt, k = LONG[0], 6

    def continued(e, start):
        """The cached_tokens SGLang reports for a continued row (read off the stream)."""
        seen, real = [], e.engine.generate

        def spy(**kw):
            for chunk in real(**kw):
                seen.append(chunk)
                yield chunk

        e.engine.generate = spy
        try:
            e.generate([start], _greedy(12), _request([12 - k], [0], groups_needed=1))
        finally:
            e.engine.generate = real
        return [c["meta_info"]["cached_tokens"] for c in seen if c["meta_info"]["finish_reason"] is not None]

    def run(e):
        start = prompt + e.generate([prompt], _greedy(12))[0].token_ids[:k]
        warm = continued(e, start)
        e.begin_weight_update()
        e.update_weights([(n, p.detach().clone()) for n, p in base_named_parameters(policy)])
        e.end_weight_update()
        return warm, continued(e, start), e.engine._debug_state()["ranks"][0]["stale_cache_hits"]

    warm, after_sync, stale = _in_rollout(pm, run)
    assert warm == [len(prompt) + k - 1], "the continued row's prompt + prefix came from the cache"
    assert after_sync == [0] and stale == 0


def test_group_stops_signal_the_stop_when_groups_complete_first_holds():
    """GroupStops (the owner's per-rank rule) against types.groups_complete, over random groupings and finish
    orders: the finish that makes `groups_needed` groups complete is the one that returns the rank's other rows
    (those unfinished), and only that one.
    Catches: a group counted complete one row early or late, rows already finished stopped again."""
    from hybrid_rl.rollout.sglang.partial import GroupStops
    from hybrid_rl.types import groups_complete

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        group_of = [rng.randint(0, 3) for _ in range(n)]
        needed = rng.randint(1, len(set(group_of)))
        stops = GroupStops([None, _request([1] * n, group_of, needed)], [2, n])
        finished = [False] * n
        signalled = []
        for row in rng.sample(range(n), n):
            before = groups_complete(group_of, finished) >= needed
            finished[row] = True
            stopped = stops.finish(2 + row)
            if not before and groups_complete(group_of, finished) >= needed:
                assert sorted(stopped) == [2 + i for i in range(n) if not finished[i]]
                signalled.append(row)
            else:
                assert stopped == []
        assert len(signalled) == 1
        assert stops.finish(0) == [] and stops.finish(1) == [], "a rank without a request never stops"


def test_sglang_abort_outputs_map_to_completions():
    """Output dicts shaped as 0.5.21 sends them (tokenizer_manager._handle_batch_output for a running request,
    _handle_abort_req for a queued one): an abort this adapter asked for keeps its tokens and log-probs ("abort"),
    or is "stop" / "length" when the token sampled after the abort ended it; an abort it did not ask for raises.
    Catches: aborted tokens dropped, an abort that ended on a stop token carried on past it."""
    from hybrid_rl.rollout.sglang.engine import to_completion

    def out(ids, reason):
        lps = [(-0.5 * (j + 1), t, None) for j, t in enumerate(ids)]
        return {"output_ids": ids, "meta_info": {"id": "r", "finish_reason": reason, "output_token_logprobs": lps}}

    running = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    queued = {"type": "abort", "message": "Abort in waiting queue"}
    got = to_completion(out([4, 5], running), 0, [1], aborted=True, budget=8)
    assert (got.token_ids, got.logprobs, got.finish_reason) == ([4, 5], [-0.5, -1.0], "abort")
    assert to_completion(out([], queued), 0, [1], aborted=True, budget=8).finish_reason == "abort"
    assert to_completion(out([4, 1], running), 0, [1], aborted=True, budget=8).finish_reason == "stop"
    assert to_completion(out([4, 5, 6], running), 0, [1], aborted=True, budget=3).finish_reason == "length"
    with pytest.raises(RuntimeError, match="aborted request 0: Aborted"):
        to_completion(out([4, 5], running), 0, [1], budget=8)


def test_a_failure_inside_the_stream_leaves_sglang_idle(setup):
    """An exception while the stream is read (here the stream itself raises after the first row finished, as SGLang's
    does for a request it refuses) reaches the caller, and the requests still running are aborted and waited for:
    the release that follows, which SGLang allows only on an idle engine, succeeds, and the next rollout works.
    Catches: requests left running after a failure (the release kills the process on SGLang)."""
    _, engine, pm = setup

    def failing(real):
        def generate(**kw):
            for chunk in real(**kw):
                yield chunk
                if chunk["meta_info"]["finish_reason"] is not None:
                    raise ValueError("boom")

        return generate

    def run(e):
        real, e.engine.generate = e.engine.generate, failing(e.engine.generate)
        try:
            with _StepDelay(e):
                e.generate([SHORT[0], LONG[0]], _greedy(30), _request([2, 30], [0, 1], groups_needed=2))
        finally:
            e.engine.generate = real

    with pytest.raises(RuntimeError, match="ValueError: boom"):
        with pm.rollout() as e:
            run(e)
    with pm.train():
        pass
    again = _in_rollout(pm, lambda e: e.generate(SHORT, _greedy(2), _request([2, 2], [0, 0], groups_needed=1)))
    assert [c.finish_reason for c in again] == ["length", "length"]


def test_a_partial_rollout_inside_a_running_event_loop(setup):
    """A notebook cell (a running loop): the streamed generate and its aborts run on the adapter's engine thread,
    where the Engine's loop can run. Last in this file: the engine keeps using that thread afterwards.
    Catches: the stream read or an abort sent from the caller's thread ("Cannot run the event loop while another
    loop is running")."""
    _, engine, pm = setup
    prompts = [LONG[0], SHORT[0]]

    async def cell():
        with _StepDelay(engine):
            return _in_rollout(pm, lambda e: e.generate(prompts, _greedy(30), _request([30, 2], [0, 1], 1)))

    got = asyncio.run(cell())
    assert engine._calls.dedicated
    assert [c.finish_reason for c in got] == ["abort", "length"] and len(got[0].token_ids) >= 3
