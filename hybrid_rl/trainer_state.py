"""The trainer's checkpoints: what it saves besides weights and optimizer state, how it finds
and checks the checkpoint to resume from, and how it restores one (the files themselves:
checkpoint.py), and `save_pretrained` (a checkpoint of the step, exported to a Hugging Face
directory). A mixin of `Trainer`, kept here so trainer.py reads as the step."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional

from hybrid_rl import checkpoint as ckpt
from hybrid_rl import distributed as D
from hybrid_rl.models.saving import declared_dtype, write_hf_metadata


class Checkpointing:
    """Needs the Trainer's cfg, policy, optimizer, scheduler, loader, kl_ctl, phases, tokenizer,
    step_idx and _model_config; `reward_norm` when the run normalises model scores."""

    def _find_resume(self) -> tuple[Optional[str], Optional[dict]]:
        """(path, meta) of the checkpoint `trainer.resume` names, checked against this run; (None, None) if none."""
        t = self.cfg.trainer
        path = None
        if t.resume != "none":
            path = ckpt.latest(t.checkpoint_root) if t.resume == "auto" else t.resume
        path = D.broadcast_object_from(path, 0)  # every rank resumes from what rank 0 found
        meta = None
        if path is not None:
            meta = ckpt.check_compatible(path, _plain_config(self.cfg), self._model_config, D.world_size(),
                                         t.resume_ignore)
        self._refuse_later_checkpoints(meta["step"] if meta else 0)
        return path, meta

    def _refuse_later_checkpoints(self, start: int) -> None:
        """Raise (every rank) when the checkpoint directory holds complete checkpoints after `start`.

        They belong to another run (trainer.resume=none in a used out_dir) or to the later steps of
        this one (resuming an older checkpoint): the new run's checkpoints would be mixed with them,
        `keep_last` would prune the new ones first (it keeps the highest steps), and a later
        resume=auto would take the other run's. Nothing is deleted: the user moves them or picks
        another out_dir."""
        root = self.cfg.trainer.checkpoint_root
        later = [step for step, _ in ckpt.complete_checkpoints(root) if step > start] if D.is_main() else None
        later = D.broadcast_object_from(later, 0)
        if later:
            steps = ", ".join(str(s) for s in later[:5]) + (", ..." if len(later) > 5 else "")
            what = "a fresh run (trainer.resume=none)" if start == 0 else f"a run resumed at step {start}"
            raise ckpt.CheckpointError(
                f"{root} holds checkpoints after step {start} (steps {steps}) that {what} would mix with its own: "
                f"keep_last would delete the new ones first and a later trainer.resume=auto would take the old "
                f"ones. Use another trainer.out_dir, resume the newest with trainer.resume=auto, or move those "
                f"step_* directories out of {root}")

    def _resume_state(self) -> dict:
        """Everything this rank's next step reads besides weights and optimizer state."""
        norm = getattr(self, "reward_norm", None)
        return {"step": self.step_idx, "loader": self.loader.state_dict(), "scheduler": self.scheduler.state_dict(),
                "kl_coef": self.kl_ctl.value, "switch_step": self.phases.step, "ledger_step": self._ledger_step,
                "reward_norm": norm.state_dict() if norm is not None else None, "rng": ckpt.rng_state()}

    def save_checkpoint(self) -> str:
        """Write a sharded checkpoint of this step (every rank calls it, between steps); returns its path."""
        t = self.cfg.trainer
        t0 = time.perf_counter()
        meta = {"model": ckpt.model_fingerprint(self._model_config), "config": _plain_config(self.cfg)}
        source_dtype = declared_dtype(self._model_config)  # the HF config records it, not the fp32 it trained in
        with self.phases.checkpointable():
            path = ckpt.save(t.checkpoint_root, self.step_idx, self.policy, self.optimizer, self._resume_state(),
                             meta, lambda d: write_hf_metadata(self.policy, self.tokenizer, d, source_dtype))
        ckpt.prune(t.checkpoint_root, t.keep_last)
        D.barrier()
        self._saved_step, self._checkpoint_path = self.step_idx, path
        if D.is_main():
            print(f"checkpoint: step {self.step_idx} -> {path} ({time.perf_counter() - t0:.1f} s)")
        return path

    def _restore(self, path: str) -> None:
        with self.phases.checkpointable():
            state = ckpt.load(path, self.policy, self.optimizer)
        self.step_idx = state["step"]
        self.loader.load_state_dict(state["loader"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The optimizer state brought the lr the saved schedule set for the next step; this run's schedule
        # decides it (the same value unless trainer.resume_ignore let a decaying schedule's length change).
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * factor(self.scheduler.last_epoch)
        self.kl_ctl.value = state["kl_coef"]
        self.phases.step, self._ledger_step = state["switch_step"], state["ledger_step"]
        norm = getattr(self, "reward_norm", None)
        if (norm is None) != (state["reward_norm"] is None):
            raise ckpt.CheckpointError(f"checkpoint {path!r} was written with the reward normaliser "
                                       f"{'on' if state['reward_norm'] is not None else 'off'}; this run has it "
                                       f"{'on' if norm is not None else 'off'}")
        if norm is not None:
            norm.load_state_dict(state["reward_norm"])
        ckpt.set_rng_state(state["rng"])
        self._saved_step, self._checkpoint_path = self.step_idx, path
        if D.is_main():
            print(f"resumed from {path} at step {self.step_idx}")

    def save_pretrained(self, path: str) -> str:
        """Save the current policy and tokenizer as a Hugging Face directory (call on every rank).

        The same code as `python -m hybrid_rl.export`: a checkpoint of this step (written now
        unless one exists), exported by rank 0 without gathering the weights on any device."""
        from hybrid_rl.export import export_checkpoint

        if self.phases.inside is not None:
            raise RuntimeError(f"cannot save inside the {self.phases.inside.value} phase; save between steps")
        source = self._checkpoint_path if self._saved_step == self.step_idx else self.save_checkpoint()
        if D.is_main():
            export_checkpoint(source, path)
        D.barrier()
        return path


def _plain_config(cfg) -> dict:
    """The config as JSON-safe nested dicts (what a checkpoint records and resume compares)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))
