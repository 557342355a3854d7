"""The SGLang adapter inside a running event loop: what a Jupyter cell does to it.

SGLang's synchronous Engine methods run `loop.run_until_complete` on the loop the Engine took
when it was built (the running one, inside a cell), and the stand-in does the same
(tests/fake_sglang/sglang/srt/entrypoints/engine.py), so without the adapter's engine thread
the first call fails: "This event loop is already running" for an Engine built in the cell,
"Cannot run the event loop while another loop is running" for one built before. A cell is
played by `asyncio.run` of a coroutine that calls the adapter synchronously, as cell code does.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("torch_one_thread", "fake_sglang"), pytest.mark.slow]

PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14]]


def _policy(tiny_model_dir: str) -> torch.nn.Module:
    from hybrid_rl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _engine_and_phases(tiny_model_dir: str, policy: torch.nn.Module):
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
    from hybrid_rl.switch.phases import PhaseManager

    tok = load_tokenizer(tiny_model_dir)
    engine = SGLangEngine(policy, tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=1)
    pm = PhaseManager(
        policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), engine, torch.device("cpu"), bucket_bytes=64 << 10
    )
    return engine, pm


def _greedy_rollout(pm) -> list[list[int]]:
    """One rollout the way training does it: resume, sync, generate, release."""
    from hybrid_rl.types import SamplingParams

    with pm.rollout() as engine:
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, greedy=True))
    with pm.train():
        pass
    return [c.token_ids for c in out]


def _native_greedy(tiny_model_dir: str, policy: torch.nn.Module) -> list[list[int]]:
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.types import SamplingParams

    tok = load_tokenizer(tiny_model_dir)
    native = NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    return [c.token_ids for c in native.generate(PROMPTS, SamplingParams(max_new_tokens=8, greedy=True))]


def test_an_engine_built_in_a_cell_starts_syncs_and_generates(tiny_model_dir):
    policy = _policy(tiny_model_dir)

    async def cell():
        engine, pm = _engine_and_phases(tiny_model_dir, policy)  # its start-up release is an engine call
        try:
            return _greedy_rollout(pm), engine._calls.dedicated
        finally:
            engine.shutdown()

    got, dedicated = asyncio.run(cell())
    assert dedicated, "inside a running loop the engine gets its own thread"
    assert got == _native_greedy(tiny_model_dir, policy), "the sync loaded the policy's weights"


def test_an_engine_built_before_the_cell_works_inside_it_and_after(tiny_model_dir):
    policy = _policy(tiny_model_dir)
    engine, pm = _engine_and_phases(tiny_model_dir, policy)
    try:

        async def cell():
            return _greedy_rollout(pm)

        want = _native_greedy(tiny_model_dir, policy)
        assert asyncio.run(cell()) == want
        assert _greedy_rollout(pm) == want, "a script's call after the cell still works"
    finally:
        engine.shutdown()
