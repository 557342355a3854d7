"""Resolve the offload settings of a run: explicit flags, or the planner's advice (`offload.auto`).

Called once before the model is built, so a run that cannot fit says so up front.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid_rl.plan import memory as memory_plan
from hybrid_rl.plan.from_config import plan_from_config


@dataclass
class OffloadDecision:
    """The offload flags the phase switch acts on."""

    optimizer: bool
    ref: bool
    params: bool
    message: str
    reward_model: bool = False
    plan: Optional[memory_plan.MemoryPlan] = None  # offload.auto on CUDA: the plan the flags come from


def decide_offload(
    cfg, device: torch.device, world_size: int, mixed_precision: bool, prompt_tokens: int
) -> OffloadDecision:
    """Turn `cfg.offload` into the flags the phase switch uses.

    prompt_tokens: the longest training prompt in tokens. With offload.auto on CUDA the flags are those of
    plan.from_config.plan_from_config, the plan recipes/grpo_7b.py's dry run prints for the same config and
    prompt length. Warnings, not errors, for flags that name a role the run does not have.
    """
    offload = cfg.offload
    has_ref, has_rm = cfg.algorithm.needs_ref_model, bool(cfg.reward.model_path)
    if offload.reward_model and not has_rm:
        warnings.warn(
            "offload.reward_model is set but this run has no reward model (reward.model_path is empty); ignored"
        )
    ref = offload.ref
    if offload.ref and not has_ref and not offload.auto:
        ref = False  # nothing to move; the default is on, so no warning
    if not offload.auto:
        return OffloadDecision(
            offload.optimizer,
            ref,
            offload.params,
            "offload: as configured",
            reward_model=offload.reward_model and has_rm,
        )
    if device.type != "cuda":
        return OffloadDecision(
            False, False, False, "offload.auto: on CPU the device is the host memory, so nothing is offloaded"
        )
    gib = torch.cuda.get_device_properties(device).total_memory / memory_plan.GIB
    plan, advice = plan_from_config(cfg, world_size, gib, prompt_tokens=prompt_tokens, mixed_precision=mixed_precision)
    flags = advice["offload"]
    if not advice["fits"]:
        warnings.warn(f"offload.auto: {advice['message']}")
    return OffloadDecision(
        flags["optimizer"],
        has_ref and flags["ref"],
        flags["params"],
        f"offload.auto ({gib:.0f} GiB per GPU): {advice['message']}",
        reward_model=has_rm and flags["reward_model"],
        plan=plan,
    )


def sglang_kv_room_warning(
    optimizer_bytes: int, free_bytes: int, mem_fraction: float | None, optimizer_offloaded: bool
) -> str | None:
    """Why SGLang's KV cache may not fit from the second rollout on, or None when it will.

    SGLang sizes its KV pool once, at start-up, from the memory free then: it takes
    `mem_fraction` of it (`mem_fraction_static`, sglang-api.md 1.2) and leaves the rest to
    this process. AdamW creates its state (two fp32 tensors per parameter) at the first
    optimizer step, after that. If the state stays on the device through ROLLOUT, it must
    fit in what SGLang left, or resuming the KV cache runs out of memory on step 2.
    optimizer_bytes and free_bytes are this rank's.
    """
    if optimizer_offloaded or optimizer_bytes <= 0:
        return None
    gib = 1024**3
    most = max(0.0, 1.0 - 1.1 * optimizer_bytes / max(free_bytes, 1))  # 10% margin for the allocator
    fix = f"set offload.optimizer=true, or rollout.mem_fraction <= {most:.2f}"
    if mem_fraction is None:
        return (
            f"rollout.engine=sglang with offload.optimizer=false and rollout.mem_fraction=null: SGLang picks "
            f"its own fraction of the {free_bytes / gib:.1f} GiB free at start-up, before the optimizer state "
            f"({optimizer_bytes / gib:.1f} GiB on this rank) exists, so resuming its KV cache on step 2 can run "
            f"out of memory; {fix}"
        )
    left = free_bytes * (1.0 - mem_fraction)
    if optimizer_bytes > left:
        return (
            f"rollout.mem_fraction={mem_fraction} leaves {left / gib:.1f} GiB of the {free_bytes / gib:.1f} GiB "
            f"free at start-up, less than the optimizer state ({optimizer_bytes / gib:.1f} GiB on this rank) "
            f"that stays on the device during ROLLOUT, so resuming SGLang's KV cache on step 2 can run out of "
            f"memory; {fix}"
        )
    return None
