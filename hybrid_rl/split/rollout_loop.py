"""The rollout ranks' loop of a split run: weights in, the colocated ROLLOUT + REWARD stage, groups out.

Per batch b of this fit(): receive the versions `syncs_before(b, v, k)` (schedule.py: exactly version
max(0, b - k), whatever arrives sooner), run rollout_stage.RolloutStage on this rank's own PromptLoader
slice (the stage's sampling seeds from b, as a colocated step seeds from its finished steps), tag every
group with the version that made it, and send the groups and a JSON report (the stage's metrics, seconds,
tokens, the loader's position after the batch) to learner rank 0. Nothing switches phases here: the engine
and its weights stay resident.
"""
from __future__ import annotations

import time

from hybrid_rl.metrics import StageTimer
from hybrid_rl.split.comm import SplitComm, start_message
from hybrid_rl.split.schedule import syncs_before
from hybrid_rl.split.staleness import VersionedGroup
from hybrid_rl.split.transport import send_groups, send_json
from hybrid_rl.split.weight_sync import receive_weights


class RolloutSide:
    def __init__(self, comm: SplitComm, stage, engine, loader, rows: list[dict], max_staleness: int):
        """stage: the RolloutStage; loader: this rank's PromptLoader (rank r - (W - R) of R); rows: the dataset
        (a group travels with its row's index)."""
        self.comm, self.stage, self.engine, self.loader, self.k = comm, stage, engine, loader, max_staleness
        self.row_index = {id(r): i for i, r in enumerate(rows)}
        self.version = 0  # the weights the engine holds

    def run(self) -> int:
        """One fit()'s batches, as learner rank 0's start message says; returns how many were sent."""
        start = start_message(self.comm, 0, 0, None)
        if start["loader"] is not None:
            self.loader.load_state_dict(start["loader"])
        if start["first"] > 0:  # the learner sends its weights first (a resumed run, or a second fit)
            self._receive(start["first"])
        for b in range(start["first"], start["last"] + 1):
            self.batch(b)
        return start["last"] + 1 - start["first"]

    def _receive(self, version: int) -> float:
        stats = receive_weights(self.engine, version, src=0, group=self.comm.sync_group,
                                timeout_s=self.comm.timeout_s)
        self.version = version
        return stats.seconds

    def batch(self, b: int) -> None:
        t0, synced = time.perf_counter(), 0.0
        for v in syncs_before(b, self.version, self.k):
            synced += self._receive(v)
        wait = time.perf_counter() - t0 - synced
        timer = StageTimer()
        batch, metrics = self.stage.run(self.engine, self.loader, b, timer)
        groups = self.versioned(batch)
        dst, peer = 0, "learner rank 0"
        send_groups(groups, dst, self.comm.timeout_s, peer=peer)
        report = {"batch": b, "version": self.version, "metrics": metrics, "wait_s": wait, "sync_s": synced,
                  "tokens": sum(len(c.token_ids) for g in groups for c in g.completions),
                  "time/rollout": timer.seconds.get("time/rollout", 0.0),
                  "time/reward": timer.seconds.get("time/reward", 0.0), "loader": self.loader.state_dict()}
        send_json(report, dst, self.comm.timeout_s, peer=peer)

    def versioned(self, batch) -> list[VersionedGroup]:
        """The batch's groups, each tagged with the version this rank holds (every token made by it)."""
        if batch is None:
            return []
        G = batch.group_size
        return [VersionedGroup(self.row_index[id(row)], batch.prompt_ids[i], batch.completions[i * G:(i + 1) * G],
                               batch.rewards_N[i * G:(i + 1) * G].tolist(), batch.scores_N[i * G:(i + 1) * G].tolist(),
                               self.version)
                for i, row in enumerate(batch.rows)]
