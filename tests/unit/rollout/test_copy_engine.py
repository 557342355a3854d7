"""An engine with its own copy of the weights: bucketed sync, real release, same samples as the policy."""

from __future__ import annotations

import copy

import torch

from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.switch.phases import PhaseManager
from hybrid_rl.types import SamplingParams


def test_copy_engine_syncs_releases_and_matches_policy(tiny_model):
    policy = tiny_model
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1 * torch.randn_like(p))  # differ from the engine's stale copy below
    stale = copy.deepcopy(policy)
    with torch.no_grad():
        for p in stale.parameters():
            p.zero_()
    engine = NativeEngine(stale, pad_id=0, eos_id=1, own_weights=True)
    opt = torch.optim.AdamW(policy.parameters())
    # A small bucket bound forces several buckets.
    pm = PhaseManager(policy, opt, engine, torch.device("cpu"), bucket_bytes=64 << 10)
    assert not pm.zero_copy
    params = SamplingParams(max_new_tokens=5, greedy=True)
    prompts = [[4, 5, 6, 14], [9, 14]]
    with pm.rollout() as e:
        got = e.generate(prompts, params)
        assert e.memory_bytes()["engine_weights"] == sum(p.numel() * 4 for p in policy.parameters())
    expected = NativeEngine(policy, pad_id=0, eos_id=1).generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    stats = pm.pop_stats()
    assert stats.bytes["sync_weights"] == sum(p.numel() * 4 for p in policy.parameters())
    # Released: the engine's parameters hold no memory until the next sync.
    assert engine.memory_bytes()["engine_weights"] == 0
    assert all(p.numel() == 0 for p in stale.parameters())
    with pm.score():
        pass
    with pm.train():
        pass
    with pm.rollout() as e:
        again = e.generate(prompts, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in expected]
