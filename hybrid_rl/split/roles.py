"""What the Trainer builds and calls for `trainer.placement=split`, by role (split/__init__.py), from the parts
it hands over: the Trainer dispatches, these build (the Trainer itself is never passed).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from hybrid_rl.split.comm import SplitComm, setup_split
from hybrid_rl.split.learner import CarriedSamples, LearnerSide, NoEngine
from hybrid_rl.split.rollout_loop import RolloutSide
from hybrid_rl.split.staleness import StalenessRule
from hybrid_rl.split.validation import ResidentEngine
from hybrid_rl.split.weight_sync import AdapterTarget


def setup(cfg, device: torch.device) -> Optional[SplitComm]:
    """The split run's groups and this rank's scope; None when colocated (the placement's refusals are
    split/placement.py's, run by loop/preflight.py before this)."""
    t = cfg.trainer
    if t.placement != "split":
        return None
    return setup_split(
        t.rollout_ranks,
        device,
        cfg.process_group_timeout_s,
        reward_model=bool(cfg.reward.model_path),
        inflight=t.inflight_update == "continue",
    )


def learner_side(
    cfg, comm: Optional[SplitComm], loader, rows: list[dict], pad_id: int, device: torch.device, mixed: bool
) -> Optional[LearnerSide]:
    """The learner's side of the loop (None when colocated); weights sync in the inference dtype, adapters only
    with LoRA."""
    if comm is None:
        return None
    t = cfg.trainer
    return LearnerSide(
        comm,
        StalenessRule(t.max_staleness, t.stale_samples),
        cfg.data.batch_size,
        rows,
        pad_id,
        device,
        torch.bfloat16 if mixed else torch.float32,
        cfg.rollout.bucket_mb << 20,
        loader,
        adapters=cfg.model.lora.enabled,
        val_every=t.val_every,
        val_before_train=t.val_before_train,
        schedule_k=schedule_k(cfg),
        inflight=t.inflight_update == "continue",
    )


def learner_carried() -> CarriedSamples:
    """rollout.partial on a learner: every rollout rank's carried samples as of the batch last trained."""
    return CarriedSamples()


def schedule_k(cfg) -> int:
    """How many versions ahead the rollout ranks may run (staleness.py admission): trainer.max_staleness, and one
    less with rollout.partial. Batch b then starts with version b - k + 1, so a group carried over one batch
    reaches the loss at most k versions old (the learner's rule); one carried longer is dropped and counted."""
    return cfg.trainer.max_staleness - (1 if cfg.rollout.partial else 0)


def rollout_side(
    cfg, comm: SplitComm, stage, engine, loader, rows: list[dict], validator, policy: torch.nn.Module, pool=None
) -> RolloutSide:
    """The loop; the stage scores with the reward model (if any) simply resident: nothing switches here.
    validator: the Validator over `engine` (its phases `resident_phases(engine)`); policy: this rank's copy
    (load_rollout_models), whose adapters LoRA's syncs fill."""
    module = stage.rewards.module
    phase = None if module is None else (lambda: contextlib.nullcontext(module))
    t = cfg.trainer
    return RolloutSide(
        comm,
        stage,
        engine,
        loader,
        rows,
        schedule_k(cfg),
        t.seed,
        model_phase=phase,
        validator=validator,
        val_every=t.val_every,
        val_before_train=t.val_before_train,
        adapter=AdapterTarget(policy) if cfg.model.lora.enabled else None,
        pool=pool,
        inflight=t.inflight_update == "continue",
    )


def resident_phases(engine) -> ResidentEngine:
    """What a rollout rank's Validator enters for its ROLLOUT: the resident engine (split/validation.py)."""
    return ResidentEngine(engine)


def load_rollout_models(cfg, comm: SplitComm, device: torch.device, rewards, rows: list[dict]) -> torch.nn.Module:
    """A rollout rank's own whole copy of the policy at version 0, as the learners load it (fp32 on CPU; the
    inference dtype on CUDA), in eval mode (later versions arrive through the weight sync); with LoRA the frozen
    base from model.path with the same peft adapters injected (the syncs then carry the adapters only); and the
    run's reward model, if any, loaded and probed here, before the engine sizes its cache from what is free.

    Why the reward model lives on the rollout ranks, not the learners: a group is complete there, and the
    dynamic-sampling filter needs its rewards before the group is sent; scoring on the learners would move
    the filter after the queue, and cost the learners memory their training needs. It is FSDP2-sharded over
    the rollout ranks (comm.rollout_mesh), 1/R per rank beside the engine, as colocated shards it over every
    rank: the rollout ranks already move in step (the sampling decisions and the running normaliser are
    rollout-pool collectives), so its per-micro-batch collectives add no new waiting. With R == 1 there is
    no peer to shard with: one unsharded copy, whose forward is no collective at all."""
    from hybrid_rl.models.fsdp import disable_dropout
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.lora import apply_lora

    mixed = device.type == "cuda" and cfg.model.dtype in ("auto", "bfloat16")
    model = load_causal_lm(cfg.model.path, torch.bfloat16 if mixed else torch.float32, cfg.model.attn_implementation)
    rewards.build_model(rows[:2], device, mixed, mesh=comm.rollout_mesh, whole=comm.rollout_mesh is None)
    # Dropout off before the injection, as policy_loading does; the adapters are fp32 over a bf16 base on CUDA.
    return apply_lora(disable_dropout(model), cfg.model.lora).to(device).eval()


def rollout_fit(side: RolloutSide, history: list) -> list:
    """A rollout rank's fit(): the batches learner rank 0 asks for; the metrics history stays on the learners."""
    side.run()
    return history


def learner_engine(policy: torch.nn.Module) -> NoEngine:
    return NoEngine(policy)


class RolloutCheckpoints:
    """A rollout rank's checkpointer: the learners write checkpoints and exports (policy, optimizer, the rollout
    loader's position and reward normaliser as of the last trained batch); samples in flight are dropped, not saved
    (split/__init__.py), so a rollout rank has nothing of its own to write."""

    def save(self) -> str:
        return ""

    def export(self, path: str) -> str:
        return path
