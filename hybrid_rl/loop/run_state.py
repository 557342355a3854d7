"""The run's mutable state, and the checkpointer that saves and restores it with the weights.

`RunState` is what changes from step to step besides weights and optimizer state: the step
count, the KL controller, the prompt loader's position, the reward normaliser and the metrics
history. `Checkpointer` is built from the parts a checkpoint holds (policy, optimizer,
scheduler, the run state, the phase switch's counters) and writes them with checkpoint/sharded.py;
it never sees the Trainer, so a second training loop can checkpoint with it too.

A rank file (`rank_00000.pt`) holds `RunState.state_dict()` plus the scheduler, the phase
switch's rollout count and the RNG states: the layout checkpoints have always had, so those
written before this module existed still load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hybrid_rl.checkpoint import sharded as ckpt
from hybrid_rl.config.schema import Config
from hybrid_rl.models.saving import declared_dtype, write_hf_metadata
from hybrid_rl.runtime import distributed as D


@dataclass
class RunState:
    """Everything a step reads and changes besides weights and optimizer state (this rank's)."""

    loader: Any  # data.prompts.PromptLoader: this rank's position in the prompt stream
    kl_ctl: Any  # algorithms.kl Fixed/AdaptiveKLController: the coefficient the next step uses
    reward_norm: Any = None  # rewards.combine.RunningNorm of the reward model's scores, or None
    step: int = 0  # finished steps
    ledger_rollout: int = 0  # the phase switch's rollout count at the last training rollout (memory report)
    partial: Any = None  # loop.partial.PartialRollouts: the carried samples of rollout.partial, or None
    # This process's step metrics, what fit() returns. Not saved: a resumed run's history starts at its
    # first step (metrics.jsonl keeps the earlier ones).
    history: list[dict] = field(default_factory=list)

    def state_dict(self) -> dict:
        norm = self.reward_norm
        return {
            "step": self.step,
            "loader": self.loader.state_dict(),
            "kl_coef": self.kl_ctl.value,
            "ledger_rollout": self.ledger_rollout,
            "reward_norm": norm.state_dict() if norm is not None else None,
            "partial": self.partial.state_dict() if self.partial is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Raises ValueError when the saved run had the reward normaliser on and this one off, or the reverse."""
        norm = self.reward_norm
        if (norm is None) != (state["reward_norm"] is None):
            raise ValueError(
                f"was written with the reward normaliser "
                f"{'on' if state['reward_norm'] is not None else 'off'}; this run has it "
                f"{'on' if norm is not None else 'off'}"
            )
        self.step = state["step"]
        self.loader.load_state_dict(state["loader"])
        self.kl_ctl.value = state["kl_coef"]
        self.ledger_rollout = state[_renamed(state, "ledger_rollout", "ledger_step")]
        if norm is not None:
            norm.load_state_dict(state["reward_norm"])
        self._load_partial(state.get("partial"))  # absent from checkpoints written before issue 37

    def _load_partial(self, saved: dict | None) -> None:
        """The carried samples. A resume that switched rollout.partial (allowed only through trainer.resume_ignore)
        follows one rule: switched on, the pool starts empty; switched off, the carried samples are dropped and
        said (their rows were drawn from the loader, which moves on)."""
        if self.partial is not None and saved is not None:
            self.partial.load_state_dict(saved)
            return
        pools = [saved] if saved is not None and "groups" in saved else (saved or {}).get("rollout_ranks") or []
        groups = [g for pool in pools for g in pool["groups"]]  # colocated: this rank's; split: every rollout rank's
        if groups:
            n, queued = sum(len(g["samples"]) for g in groups), sum(len(pool["queue"]) for pool in pools)
            warnings.warn(
                f"resume: the checkpoint carries {n} unfinished samples ({len(groups)} groups) of partial "
                f"rollouts and {queued} prompts not started; rollout.partial is off in this run, so "
                "they are dropped"
            )


def _renamed(saved: dict, key: str, old_key: str) -> str:
    """`key`, or the name it had in checkpoints written before issue 26 renamed it (`old_key`)."""
    return key if key in saved else old_key


def plain_config(cfg: Config) -> dict:
    """The config as JSON-safe nested dicts (what a checkpoint records and resume compares)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def find_resume(cfg: Config, model_config: dict) -> tuple[Optional[str], Optional[dict]]:
    """(path, meta) of the checkpoint `trainer.resume` names, verified (checkpoint/manifest.py) and checked
    against this run; (None, None) if none. Runs before anything is built (every rank; rank 0 decides).

    auto: the newest intact checkpoint; newer damaged ones are named with what is wrong and set aside. A path:
    refused when damaged (naming the command that recovers); when older than the newest, the later ones are
    set aside (said). Only once every check passed is anything moved, and nothing is ever deleted."""
    t = cfg.trainer
    root = t.checkpoint_root
    path, damaged = None, []
    if t.resume == "auto":
        path, damaged = ckpt.newest_intact(root)
    elif t.resume != "none":
        path = t.resume
        ckpt.check_intact(path, root)
    path = D.broadcast_object_from(path, 0)  # every rank resumes from what rank 0 found
    meta = None
    if path is not None:
        meta = ckpt.check_compatible(
            path, plain_config(cfg), model_config, D.world_size(), t.resume_ignore, defaults=plain_config(Config())
        )
    if meta is None:
        _refuse_later_checkpoints(root)
    else:
        _set_aside_later(root, path, meta["step"], dict(damaged))
    return path, meta


def _refuse_later_checkpoints(root: str) -> None:
    """Raise (every rank) when a fresh run (trainer.resume=none) finds checkpoints in its checkpoint directory.

    They belong to another run: the new run's checkpoints would be mixed with them, `keep_last` would prune
    the new ones first (it keeps the highest steps), and a later resume=auto would take the other run's.
    Nothing is moved or deleted: the user picks another out_dir or moves them."""
    later = [step for step, _ in ckpt.checkpoint_dirs(root)] if D.is_main() else None
    later = D.broadcast_object_from(later, 0)
    if later:
        steps = ", ".join(str(s) for s in later[:5]) + (", ..." if len(later) > 5 else "")
        raise ckpt.CheckpointError(
            f"{root} holds checkpoints (steps {steps}) that a fresh run (trainer.resume=none) would mix with its "
            f"own: keep_last would delete the new ones first and a later trainer.resume=auto would take the old "
            f"ones. Use another trainer.out_dir, resume the newest with trainer.resume=auto, or move those "
            f"step_* directories out of {root}"
        )


def _set_aside_later(root: str, path: str, start: int, damaged: dict[str, list[str]]) -> None:
    """Rank 0: move the checkpoints after step `start` to <root>/set_aside/ (the run goes on from `start`: its
    new checkpoints must not mix with them), saying what moved where and why; damaged ones are named with what
    is wrong. Nothing is deleted."""
    if D.is_main():
        later = [p for step, p in ckpt.checkpoint_dirs(root) if step > start]
        for p in later:
            problems = damaged.get(p)
            where = ckpt.set_aside(p, "damaged" if problems else f"after-step-{start}")
            why = (
                f"is damaged ({ckpt.describe_damage(problems)})"
                if problems
                else f"comes after step {start}, which this run resumes from"
            )
            print(f"checkpoint: {os.path.basename(p)} {why}; moved to {where} (kept, not deleted)", flush=True)
        if damaged:
            print(f"checkpoint: resuming from {path}, the newest intact checkpoint", flush=True)
        elif later:
            print(
                f"checkpoint: resuming from {path} as trainer.resume asks; the {len(later)} later checkpoint(s) are "
                f"kept in {os.path.join(root, ckpt.SET_ASIDE)} (delete them yourself once unneeded)",
                flush=True,
            )
    D.barrier()


def _restore_schedule(optimizer: torch.optim.Optimizer, scheduler, saved: dict) -> None:
    """The scheduler's saved position; the optimizer state brought the lr the saved schedule set for the next step,
    and this run's schedule decides it (the same value unless trainer.resume_ignore let a decaying schedule's
    length change)."""
    scheduler.load_state_dict(saved)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)


class Checkpointer:
    """Saves and restores a run's checkpoints (checkpoint/sharded.py) from the parts they hold.

    cfg: the run's config (trainer.checkpoint_root and keep_last; recorded in meta.json);
    model_config: the policy's config.json (its fingerprint is recorded; the HF files keep its dtype);
    phases: the phase switch (a save or load runs with its state checkpointable; its rollout count is saved)."""

    def __init__(
        self,
        cfg: Config,
        model_config: dict,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        state: RunState,
        phases,
        tokenizer,
        critic: Optional[tuple[torch.nn.Module, torch.optim.Optimizer, object]] = None,
    ):
        """critic: PPO's (critic, its optimizer, its lr scheduler), saved and restored beside the policy."""
        self.cfg, self.model_config = cfg, model_config
        self.critic = critic
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.state, self.phases, self.tokenizer = state, phases, tokenizer
        self.saved_step: Optional[int] = None  # the step of the last checkpoint this process wrote or loaded
        self.path: Optional[str] = None  # and its directory

    def rank_state(self) -> dict:
        """Everything this rank's next step reads besides weights and optimizer state."""
        return {
            **self.state.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            **({"critic_scheduler": self.critic[2].state_dict()} if self.critic else {}),
            "switch_rollouts": self.phases.rollouts,
            "rng": ckpt.rng_state(),
        }

    def _extra(self) -> Optional[dict]:
        return {"critic": self.critic[:2]} if self.critic else None

    def save(self) -> str:
        """Write a sharded checkpoint of this step (every rank calls it, between steps); returns its path."""
        t = self.cfg.trainer
        t0 = time.perf_counter()
        meta = {"model": ckpt.model_fingerprint(self.model_config), "config": plain_config(self.cfg)}
        source_dtype = declared_dtype(self.model_config)  # the HF config records it, not the fp32 it trained in
        step = self.state.step
        with self.phases.checkpointable():
            path = ckpt.save(
                t.checkpoint_root,
                step,
                self.policy,
                self.optimizer,
                self.rank_state(),
                meta,
                lambda d: write_hf_metadata(self.policy, self.tokenizer, d, source_dtype),
                trainable_only=self.cfg.model.lora.enabled,
                extra=self._extra(),
            )  # LoRA: adapters, not the frozen base
        ckpt.prune(t.checkpoint_root, t.keep_last)
        D.barrier()
        self.saved_step, self.path = step, path
        if D.is_main():
            print(f"checkpoint: step {step} -> {path} ({time.perf_counter() - t0:.1f} s)")
        return path

    def restore(self, path: str) -> None:
        with self.phases.checkpointable():
            saved = ckpt.load(
                path, self.policy, self.optimizer, trainable_only=self.cfg.model.lora.enabled, extra=self._extra()
            )
        try:
            self.state.load_state_dict(saved)
        except ValueError as err:
            raise ckpt.CheckpointError(f"checkpoint {path!r} {err}") from None
        _restore_schedule(self.optimizer, self.scheduler, saved["scheduler"])
        if self.critic:
            _restore_schedule(self.critic[1], self.critic[2], saved["critic_scheduler"])
        self.phases.rollouts = saved[_renamed(saved, "switch_rollouts", "switch_step")]
        ckpt.set_rng_state(saved["rng"])
        self.saved_step, self.path = self.state.step, path
        if D.is_main():
            print(f"resumed from {path} at step {self.state.step}")

    def export(self, path: str) -> str:
        """Save the current policy and tokenizer as a Hugging Face directory (call on every rank).

        The same code as `python -m hybrid_rl.export`: a checkpoint of this step (written now
        unless one exists), exported by rank 0 without gathering the weights on any device."""
        from hybrid_rl.checkpoint.export import export_checkpoint

        if self.phases.inside is not None:
            raise RuntimeError(f"cannot save inside the {self.phases.inside.value} phase; save between steps")
        source = self.path if self.saved_step == self.state.step else self.save()
        if D.is_main():  # LoRA: the merged model (a HF directory; the CLI writes the adapter directory)
            export_checkpoint(source, path, merge=self.cfg.model.lora.enabled)
        D.barrier()
        return path
