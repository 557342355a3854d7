"""`models.fsdp.prepare_reference`: the frozen reference in the inference dtype, as the planner bills it
(the sharded build on two ranks is tests/distributed/test_load_sharded.py's)."""

from __future__ import annotations

import functools
import os

import torch

from hybrid_rl.models.fsdp import load_sharded, prepare_policy, prepare_reference


def test_the_reference_in_bf16_is_what_the_planner_bills_and_the_ledger_counts(tiny_model_dir):
    """Catches: the reference built in the policy's fp32 under mixed precision (twice the planner's ref = b*N in
    the ledger, in pinned host memory and in offload traffic), and buffers cast with it (the rotary inv_freq must
    stay fp32, as a bf16 `from_pretrained` leaves it, or the reference computes another function)."""
    from hybrid_rl.plan import memory as memory_plan
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.switch.phases import PhaseManager

    policy, ref = load_sharded(
        tiny_model_dir,
        torch.device("cpu"),
        False,
        "sdpa",
        [
            functools.partial(prepare_policy, gradient_checkpointing=False),
            functools.partial(prepare_reference, dtype=torch.bfloat16),
        ],
    )
    assert {p.dtype for p in policy.parameters()} == {torch.float32}, "the policy keeps its fp32 masters"
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    assert {b.dtype for b in ref.buffers()} == {torch.float32}, "buffers keep their dtype"
    for (name, p), q in zip(policy.named_parameters(), ref.parameters()):
        assert torch.equal(q, p.detach().to(torch.bfloat16)), name
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    pm = PhaseManager(
        policy, opt, NativeEngine(policy, pad_id=0, eos_id=1), torch.device("cpu"), ref=ref, offload_ref=False
    )
    arch = memory_plan.ModelArch.from_hf_config(os.path.join(tiny_model_dir, "config.json"))
    plan = memory_plan.plan_memory(arch, n_gpus=1, dtype="bf16", batch=1, context=8, offload={}, gpu_mem_gib=1.0)
    assert pm.resident()["ref"] == plan.per_gpu["ref"] > 0
