"""What the Trainer builds and calls for `trainer.placement=split`, by role (split/__init__.py), from the parts
it hands over: the Trainer dispatches, these build (the Trainer itself is never passed).
"""
from __future__ import annotations

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
    if cfg.reward.model_path:
        raise ValueError("config key 'reward.model_path': a reward model is not wired into the split placement yet "
                         "(it would score on the learner ranks); use rule rewards or trainer.placement=colocated")
    if cfg.model.lora.enabled:
        raise ValueError("config key 'model.lora.enabled': LoRA is not wired into the split placement yet (the sync "
                         "would send the adapters only); use trainer.placement=colocated")
    if t.val_every or t.val_before_train:
        raise ValueError("config key 'trainer.val_every' / 'trainer.val_before_train': validation is not wired into "
                         "the split placement yet (the learners hold no engine); set both off or use colocated")
    return setup_split(t.rollout_ranks, device, t.dist_timeout_s)


def learner_side(cfg, comm: Optional[SplitComm], loader, rows: list[dict], pad_id: int, device: torch.device,
                 mixed: bool) -> Optional[LearnerSide]:
    """The learner's side of the loop (None when colocated); weights sync in the inference dtype."""
    if comm is None:
        return None
    t = cfg.trainer
    return LearnerSide(comm, StalenessRule(t.max_staleness, t.stale_samples), cfg.data.batch_size, rows, pad_id,
                       device, torch.bfloat16 if mixed else torch.float32, cfg.rollout.bucket_mb << 20, loader)


def rollout_side(cfg, comm: SplitComm, stage, engine, loader, rows: list[dict]) -> RolloutSide:
    return RolloutSide(comm, stage, engine, loader, rows, cfg.trainer.max_staleness, cfg.trainer.seed)


def load_rollout_model(cfg, device: torch.device) -> torch.nn.Module:
    """A rollout rank's own whole copy of the policy at version 0, as the learners load it (fp32 on CPU; the
    inference dtype on CUDA), in eval mode; later versions arrive through the weight sync."""
    from hybrid_rl.models.fsdp import disable_dropout
    from hybrid_rl.models.loading import load_causal_lm

    mixed = device.type == "cuda" and cfg.model.dtype in ("auto", "bfloat16")
    model = load_causal_lm(cfg.model.path, torch.bfloat16 if mixed else torch.float32, cfg.model.attn_implementation)
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
