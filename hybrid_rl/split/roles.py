"""What the Trainer builds and calls for `trainer.placement=split`, by role (split/__init__.py), from the parts
it hands over: the Trainer dispatches, these build (the Trainer itself is never passed).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from hybrid_rl.split.comm import SplitComm, setup_split
from hybrid_rl.split.learner import LearnerSide, NoEngine
from hybrid_rl.split.rollout_loop import RolloutSide
from hybrid_rl.split.staleness import StalenessRule


def setup(cfg, device: torch.device) -> Optional[SplitComm]:
    """The split run's groups and this rank's scope; None when colocated. Refuses what this wiring does not
    run yet, naming the key."""
    t = cfg.trainer
    if t.placement != "split":
        return None
    if cfg.reward.model_path and cfg.reward.normalize_model:
        raise ValueError(
            "config key 'reward.normalize_model': the running normaliser of the reward model's scores "
            "lives on the rollout ranks in the split placement, and a checkpoint (written by the "
            "learners) does not carry it yet, so a resumed run would restart it; set it false (weight "
            "the model part with reward.weights.model instead) or use trainer.placement=colocated"
        )
    if cfg.model.lora.enabled:
        raise ValueError(
            "config key 'model.lora.enabled': LoRA is not wired into the split placement yet (the sync "
            "would send the adapters only); use trainer.placement=colocated"
        )
    if t.val_every or t.val_before_train:
        raise ValueError(
            "config key 'trainer.val_every' / 'trainer.val_before_train': validation is not wired into "
            "the split placement yet (the learners hold no engine); set both off or use colocated"
        )
    return setup_split(t.rollout_ranks, device, cfg.process_group_timeout_s, reward_model=bool(cfg.reward.model_path))


def learner_side(
    cfg, comm: Optional[SplitComm], loader, rows: list[dict], pad_id: int, device: torch.device, mixed: bool
) -> Optional[LearnerSide]:
    """The learner's side of the loop (None when colocated); weights sync in the inference dtype."""
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
    )


def rollout_side(cfg, comm: SplitComm, stage, engine, loader, rows: list[dict]) -> RolloutSide:
    """The loop; the stage scores with the reward model (if any) simply resident: nothing switches here."""
    module = stage.rewards.module
    phase = None if module is None else (lambda: contextlib.nullcontext(module))
    return RolloutSide(
        comm, stage, engine, loader, rows, cfg.trainer.max_staleness, cfg.trainer.seed, model_phase=phase
    )


def load_rollout_models(cfg, comm: SplitComm, device: torch.device, rewards, rows: list[dict]) -> torch.nn.Module:
    """A rollout rank's own whole copy of the policy at version 0, as the learners load it (fp32 on CPU; the
    inference dtype on CUDA), in eval mode (later versions arrive through the weight sync); and the run's
    reward model, if any, loaded and probed here, before the engine sizes its cache from what is free.

    Why the reward model lives on the rollout ranks, not the learners: a group is complete there, and the
    dynamic-sampling filter needs its rewards before the group is sent; scoring on the learners would move
    the filter after the queue, and cost the learners memory their training needs. It is FSDP2-sharded over
    the rollout ranks (comm.rollout_mesh), 1/R per rank beside the engine, as colocated shards it over every
    rank: the rollout ranks already move in step (the sampling decisions and the running normaliser are
    rollout-pool collectives), so its per-micro-batch collectives add no new waiting. With R == 1 there is
    no peer to shard with: one unsharded copy, whose forward is no collective at all."""
    from hybrid_rl.models.fsdp import disable_dropout
    from hybrid_rl.models.loading import load_causal_lm

    mixed = device.type == "cuda" and cfg.model.dtype in ("auto", "bfloat16")
    model = load_causal_lm(cfg.model.path, torch.bfloat16 if mixed else torch.float32, cfg.model.attn_implementation)
    rewards.build_model(rows[:2], device, mixed, mesh=comm.rollout_mesh, whole=comm.rollout_mesh is None)
    return disable_dropout(model).to(device).eval()


def rollout_fit(side: RolloutSide, history: list) -> list:
    """A rollout rank's fit(): the batches learner rank 0 asks for; the metrics history stays on the learners."""
    side.run()
    return history


def learner_engine(policy: torch.nn.Module) -> NoEngine:
    return NoEngine(policy)


class RolloutCheckpoints:
    """A rollout rank's checkpointer: the learners write checkpoints and exports (policy, optimizer, the rollout
    loader's position as of the last trained batch); samples in flight are dropped, not saved
    (split/__init__.py), so a rollout rank has nothing of its own to write."""

    def save(self) -> str:
        return ""

    def export(self, path: str) -> str:
        return path
