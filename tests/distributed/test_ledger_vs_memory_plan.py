"""On the tiny model the planner's byte counts equal what the ledger measures (2 gloo ranks, fp32)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow

N_LOCAL, PROMPT, NEW = 3, 5, 4  # sequences per rank, prompt tokens, generated tokens


def _rank_fn(rank: int, model_dir: str) -> dict:
    import copy

    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.switch.phases import PhaseManager
    from hybrid_rl.types import SamplingParams

    dev = D.init("cpu", timeout_s=60)
    base = load_causal_lm(model_dir)
    ref = shard_model(copy.deepcopy(base).requires_grad_(False), dev, False)
    model = shard_model(base, dev, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(4, 15, (2, 6))
    model(input_ids=ids).logits.sum().backward()
    opt.step()
    # eos_id -1 never matches, so every row decodes all NEW tokens: the KV cache is full-length.
    pm = PhaseManager(model, opt, NativeEngine(model, pad_id=0, eos_id=-1), dev, ref=ref, offload_ref=False)
    with pm.rollout() as engine:
        engine.generate([[4 + i] * PROMPT for i in range(N_LOCAL)], SamplingParams(max_new_tokens=NEW, seed=rank))
    with pm.score():
        pass
    with pm.train():
        model(input_ids=ids).logits.sum().backward()
    return {s.label: s.roles for s in pm.ledger.rollout_snapshots(pm.rollouts)}


def test_planner_matches_ledger_on_tiny_model(tiny_model_dir):
    from hybrid_rl.plan import memory as memory_plan

    ranks = run_ranks(_rank_fn, world=2, args=(tiny_model_dir,))
    arch = memory_plan.ModelArch.from_hf_config(os.path.join(tiny_model_dir, "config.json"))
    # The KV cache holds the prompt and every fed-back token: PROMPT + NEW - 1 positions.
    plan = memory_plan.plan_memory(
        arch,
        n_gpus=2,
        dtype="fp32",
        batch=2 * N_LOCAL,
        context=PROMPT + NEW - 1,
        offload={"optimizer": False, "ref": False, "params": False, "reward_model": False},
        gpu_mem_gib=1.0,
    )
    # Sharded roles: the shards of the two ranks add up to the planner's total.
    for role, label in [
        ("policy_weights", "train:end"),
        ("grads", "train:end"),
        ("optimizer", "train:end"),
        ("ref", "score:ready"),
    ]:
        measured = sum(r[label][role] for r in ranks)
        assert measured == plan.total[role], f"{role}: ledger {measured} != planner {plan.total[role]}"
        assert measured > 0
    # Per-rank roles: every rank holds a whole inference copy and its own sequences' KV cache.
    for r in ranks:
        assert r["rollout:ready"]["engine_weights"] == plan.per_gpu["engine_weights"]
        assert r["rollout:generated"]["kv_cache"] == plan.per_gpu["kv_cache"] > 0
        assert r["train:end"]["engine_weights"] == 0 and r["train:end"]["kv_cache"] == 0
        assert r["rollout:ready"]["grads"] == 0, "gradients are freed before rollout"
    # Phase totals agree too (nothing offloaded: the planner keeps every role resident).
    for phase, label in [("train", "train:end"), ("score", "score:ready"), ("rollout", "rollout:generated")]:
        measured = sum(sum(r[label].values()) for r in ranks)
        assert measured == 2 * plan.phase_totals[phase], (
            f"{phase}: ledger {measured} != planner {2 * plan.phase_totals[phase]}"
        )
