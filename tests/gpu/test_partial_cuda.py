"""Partial rollouts (issue 37) on the native engine on CUDA, each decode path: a carried prefix continues to the
uninterrupted greedy tokens, and the early stop returns the unfinished rows with their prefixes. The stop checks run
every 8 tokens on CUDA (the CPU tests check every token), and the graph path shrinks to graph sizes. Skipped without
CUDA; run with `pytest tests/gpu` (benchmarks/gpu_session.sh runs it)."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.types import PartialRequest, SamplingParams
from tests.gpu.test_native_engine_cuda import EOS, PAD, PATHS, PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

T = 20


def _greedy(max_new: int = T, min_new: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, min_new_tokens=min_new, greedy=True)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_carried_prefix_continues_to_the_uninterrupted_tokens_on_cuda(model, path):
    eng = NativeEngine(model, PAD, EOS, **PATHS[path])
    ref = eng.generate(PROMPTS, _greedy(min_new=T))
    assert eng.last_decode_path == path, eng.last_graph_error
    cuts = [0, 9, 3, 17]
    prompts = [p + r.token_ids[:k] for p, r, k in zip(PROMPTS, ref, cuts)]
    req = PartialRequest(tuple(T - k for k in cuts), tuple(T - k for k in cuts), (0, 1, 2, 3), 4)
    got = eng.generate(prompts, _greedy(), req)
    for r, g, k in zip(ref, got, cuts):
        assert r.token_ids[:k] + g.token_ids == r.token_ids
        assert g.logprobs == pytest.approx(r.logprobs[k:], abs=1e-4)


@pytest.mark.parametrize("path", list(PATHS))
def test_the_early_stop_on_cuda_keeps_each_prefix(model, path):
    """Group {0, 1} has 2-token budgets, group {2, 3} 20 tokens with no stop allowed: one group needed, the call
    stops at the first check after 2 tokens (8 on CUDA), and rows 2 and 3 come back "abort" with the prefix they
    had then."""
    eng = NativeEngine(model, PAD, EOS, **PATHS[path])
    ref = eng.generate(PROMPTS, _greedy(min_new=T))
    req = PartialRequest((2, 2, T, T), (2, 2, T, T), (0, 0, 1, 1), 1)
    got = eng.generate(PROMPTS, _greedy(), req)
    assert [c.finish_reason for c in got] == ["length", "length", "abort", "abort"]
    assert [len(c.token_ids) for c in got] == [2, 2, 8, 8]
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids[: len(g.token_ids)]
    assert eng.generate(PROMPTS, _greedy(min_new=T))[3].token_ids == ref[3].token_ids


@pytest.mark.parametrize("path", list(PATHS))
def test_kept_caches_continue_to_the_uninterrupted_tokens_on_cuda(model, path):
    """rollout.partial_kv=keep on CUDA: rows 2 and 3 cut after 8 tokens (the first check) hand back host copies of
    their caches; continued over them (copied back in, graphs captured over the kept layout) under unchanged
    weights, prefix + continuation is the uninterrupted run."""
    eng = NativeEngine(model, PAD, EOS, **PATHS[path])
    ref = eng.generate(PROMPTS, _greedy(min_new=T))
    req = PartialRequest((2, 2, T, T), (2, 2, T, T), (0, 0, 1, 1), 1, keep_kv=True)
    got = eng.generate(PROMPTS, _greedy(), req)
    kept = eng.last_kept_kv
    assert kept[0] is None and kept[1] is None
    assert all(k.device.type == "cpu" and k.shape[3] == len(p) + 7 for k, p in zip(kept[2:], PROMPTS[2:]))
    rows = [p + g.token_ids for p, g in zip(PROMPTS[2:], got[2:])]
    left = tuple(T - len(g.token_ids) for g in got[2:])
    again = eng.generate(rows, _greedy(), PartialRequest(left, left, (0, 1), 2, kv=tuple(kept[2:])))
    assert eng.last_decode_path == path, eng.last_graph_error
    for r, g, a in zip(ref[2:], got[2:], again):
        assert g.token_ids + a.token_ids == r.token_ids
        assert a.logprobs == pytest.approx(r.logprobs[len(g.token_ids) :], abs=1e-4)
