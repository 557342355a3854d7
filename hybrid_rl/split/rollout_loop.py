"""The rollout ranks' loop of a split run: weights in, the colocated ROLLOUT + REWARD stage, groups out.

Per batch b of this fit(): receive the versions `syncs_before(b, v, k)` (schedule.py: exactly version
max(0, b - k), whatever arrives sooner), run rollout_stage.RolloutStage (with the reward model, if any,
resident on these ranks: split/roles.py load_rollout_models) on this rank's own PromptLoader
slice (the stage's sampling seeds from b, as a colocated step seeds from its finished steps), tag every
group with the version that made it, and send the groups and a JSON report (the stage's metrics, seconds,
tokens, the loader's position and the reward normaliser's state after the batch, a signal this rank received) to
learner rank 0. Nothing switches phases here: the engine and its weights stay resident. The start message
restores the loader and the normaliser (a resumed run's state as of its last trained batch).

Validation (split/validation.py): a validated version is validated as soon as it is held (before the next batch),
one sent for validation alone after the last batch; each is a JSON message to learner rank 0. LoRA: every sync
is adapter-only (weight_sync.AdapterTarget), the first one too (learner rank 0's initial adapter draw).

Signals: SIGTERM / SIGINT on a rollout rank do not stop it (the learners decide, so that their checkpoint
is written while the batch they wait for still arrives): the signal travels in the next report, the learners
stop after their step, and learner rank 0 sends STOP where the next weights would come (weight_sync.py),
which ends this loop at once. A second signal stops at once. Python's, NumPy's and torch's global generators
are reseeded per batch from (trainer.seed, batch, rank): a reward that draws from them gives the same values
for batch b in a resumed run as in an uninterrupted one, with nothing of the rollout rank's to checkpoint.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from hybrid_rl.checkpoint.sharded import seed_all
from hybrid_rl.observability.metrics import StageTimer
from hybrid_rl.runtime import distributed as D
from hybrid_rl.runtime.stop import StopSignal
from hybrid_rl.split.comm import SplitComm, start_message
from hybrid_rl.split.inflight import InflightEngine, TakeOffered
from hybrid_rl.split.schedule import syncs_before
from hybrid_rl.split.staleness import VersionedGroup
from hybrid_rl.split.transport import send_groups, send_json
from hybrid_rl.split.validation import validation_steps
from hybrid_rl.split.weight_sync import AdapterTarget, SyncStopped, receive_weights


class RolloutSide:
    def __init__(
        self,
        comm: SplitComm,
        stage,
        engine,
        loader,
        rows: list[dict],
        max_staleness: int,
        seed: int = 0,
        model_phase=None,
        validator=None,
        val_every: int = 0,
        val_before_train: bool = False,
        adapter: Optional[AdapterTarget] = None,
        pool=None,
        inflight: bool = False,
    ):
        """stage: the RolloutStage (its rewards' norm is the reward normaliser, or None); loader: this rank's
        PromptLoader (rank r - (W - R) of R); rows: the dataset (a group travels with its row's index); seed:
        trainer.seed (the per-batch reseed); model_phase: the reward model's context for the stage (None without
        one): it yields the resident module; validator: loop/validation.Validator over the engine (its phases a
        split.validation.ResidentEngine), with trainer.val_every / val_before_train; adapter: LoRA's target of
        the adapter-only syncs (None: full weights); pool: rollout.partial's loop.partial.PartialRollouts of this
        rank (None: off), whose state travels with each report and comes back in the start message; inflight:
        trainer.inflight_update=continue, the stage's engine takes versions between decode steps (inflight.py)."""
        self.comm, self.stage, self.engine, self.loader, self.k = comm, stage, engine, loader, max_staleness
        self.model_phase, self.norm = model_phase, stage.rewards.norm
        self.validator, self.val_every, self.val_before_train = validator, val_every, val_before_train
        self.adapter, self.pool = adapter, pool
        self.seed, self.signal = seed, None
        self.row_index = {id(r): i for i, r in enumerate(rows)}
        self.version = 0  # the weights the engine holds
        self.val_due: set[int] = set()  # versions this fit() still validates
        self.updates: Optional[TakeOffered] = None
        self.stage_engine = engine  # what the stage generates with
        if inflight:
            me = torch.distributed.get_rank()
            self.updates = TakeOffered(D.store(), me, self._receive, lambda: self.version, self.val_due.__contains__)
            self.stage_engine = InflightEngine(engine, self.updates)

    def run(self) -> int:
        """One fit()'s batches, as learner rank 0's start message says; returns how many were sent (fewer when
        the learners stopped early)."""
        start = start_message(self.comm, 0, 0, None)
        if start["loader"] is not None:
            self.loader.load_state_dict(start["loader"])
        if start["reward_norm"] is not None:
            self.norm.load_state_dict(start["reward_norm"])
        if self.updates is not None:  # this fit's offers only
            self.updates.start(start["fit"])
        if self.pool is not None and start.get("partial") is not None:  # this rank's carried samples, as trained
            self.pool.load_state_dict(start["partial"][D.rank()])
        steps = validation_steps(start["first"], start["last"], self.val_every, self.val_before_train)
        self.val_due.clear()  # the poller reads this set: updated in place
        self.val_due.update(steps)
        self.signal, sent = StopSignal(), 0
        try:
            if start["first"] > 0 or self.adapter is not None:  # a resumed run, a second fit, LoRA's first draw
                self._receive(start["first"])
            self._validate_held()
            for b in range(start["first"], start["last"] + 1):
                self.batch(b)
                sent += 1
            while self.updates is not None and self.version < start["last"]:  # continue: versions no batch took
                self._receive(self.version + 1)
                self._validate_held()
            for v in sorted(self.val_due):  # versions no batch is made with, sent for their validation
                self._receive(v)
                self._validate_held()
        except SyncStopped:
            pass  # the learners stopped (a signal) after their checkpoint: nothing more is wanted
        finally:
            self.signal.restore()
        return sent

    def _receive(self, version: int) -> float:
        """Apply `version` (from learner rank 0 over the sync group, or under continue over this rank's pair group, once
        learner rank 0's sender for this rank hears that it waits: inflight.TakeOffered.want)."""
        pairs = self.comm.pairs
        if self.updates is not None:
            self.updates.want(version)
        stats = receive_weights(
            self.engine,
            version,
            src=0,
            group=self.comm.sync_group if pairs is None else pairs[torch.distributed.get_rank()],
            timeout_s=self.comm.timeout_s,
            adapter=self.adapter,
        )
        self.version = version
        return stats.seconds

    def _validate_held(self) -> float:
        """Validate the version held if this fit() validates it (its step's validation); returns the seconds."""
        if self.version not in self.val_due:
            return 0.0
        t0, step = time.perf_counter(), self.version
        self.val_due.discard(step)
        seed_all(self.seed + 1_000_003 * (step + 1) + 7919 * D.rank() + 104_729)  # not any batch's seeds
        metrics, samples = self.validator.measure(step)
        msg = {"val_step": step, "version": self.version, "metrics": metrics, "samples": samples}
        send_json(msg, 0, self.comm.timeout_s, peer="learner rank 0")
        return time.perf_counter() - t0

    def batch(self, b: int) -> None:
        t0, synced, validated = time.perf_counter(), 0.0, 0.0
        for v in syncs_before(b, self.version, self.k):
            synced += self._receive(v)
            validated += self._validate_held()
        wait = time.perf_counter() - t0 - synced - validated
        seed_all(self.seed + 1_000_003 * (b + 1) + 7919 * D.rank())
        timer, held = StageTimer(), self.version
        taken, taken_s = (len(self.updates.applied), self.updates.seconds) if self.updates else (0, 0.0)
        if self.pool is None:
            batch, metrics = self.stage.run(self.stage_engine, self.loader, b, timer, model_phase=self.model_phase)
            # Under continue every completion says the version of each of its tokens (inflight.InflightEngine).
            tv = [c.versions for c in batch.completions] if self.updates is not None and batch is not None else None
            groups = self.versioned(batch, held, tv)
        else:  # carried samples continue under the weights held; each token keeps its version
            batch, metrics = self.stage.run_partial(
                self.stage_engine, self.pool, self.loader, b, timer, self.model_phase, version=held
            )
            groups = self.versioned(batch, held, self.stage.last_token_versions)
        dst, peer = 0, "learner rank 0"
        send_groups(groups, dst, self.comm.timeout_s, peer=peer)
        report = {
            "batch": b,
            "version": held,
            "inflight_updates": len(self.updates.applied) - taken if self.updates else 0,
            "inflight_sync_s": self.updates.seconds - taken_s if self.updates else 0.0,
            "metrics": metrics,
            "wait_s": wait,
            "sync_s": synced,
            "tokens": sum(len(c.token_ids) for g in groups for c in g.completions),
            "time/rollout": timer.seconds.get("time/rollout", 0.0),
            "time/reward": timer.seconds.get("time/reward", 0.0),
            "loader": self.loader.state_dict(),
            "reward_norm": self.norm.state_dict() if self.norm is not None else None,
            # Without the kept caches (rollout.partial_kv=keep): the report crosses to the learners every batch.
            "partial": self.pool.state_dict(caches=False) if self.pool is not None else None,
            "signal": self.signal.signum if self.signal else 0,
        }
        send_json(report, dst, self.comm.timeout_s, peer=peer)

    def versioned(self, batch, held: int, token_versions: Optional[list[list[int]]] = None) -> list[VersionedGroup]:
        """The batch's groups, each tagged with the version `held` at the batch's start (every token made by it), or
        with partial rollouts or in-flight updates each token's own version (`token_versions`, per completion) and the
        group's oldest."""
        if batch is None:
            return []
        G, out = batch.group_size, []
        for i, row in enumerate(batch.rows):
            tv = None if token_versions is None else token_versions[i * G : (i + 1) * G]
            firsts = [vs[0] for vs in tv if vs] if tv is not None else []
            out.append(
                VersionedGroup(
                    self.row_index[id(row)],
                    batch.prompt_ids[i],
                    batch.completions[i * G : (i + 1) * G],
                    batch.rewards_N[i * G : (i + 1) * G].tolist(),
                    batch.scores_N[i * G : (i + 1) * G].tolist(),
                    min(firsts) if firsts else held,
                    tv,
                )
            )
        return out
