"""THE phase switch. The only place that decides what is resident in which phase.

States and the only legal moves (one training step goes round the cycle):

    TRAIN --rollout()--> ROLLOUT --score()--> SCORE --train()--> TRAIN
                            \\-----------train()-------------------/

to ROLLOUT: zero grads (set_to_none) -> offload optimizer state (if configured) ->
            engine.resume(["weights"]) -> sync weights (skipped when the engine runs
            the policy module itself) -> engine.resume(["kv_cache"])
leaving ROLLOUT: engine.release(["kv_cache", "weights"])
to SCORE:   onload the reference model; leaving SCORE: offload it (if configured)
to TRAIN:   onload optimizer state

Every stage is timed and its bytes counted into `self.stats` (drained per step).
"""
from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from hybrid_rl.hybrid import offload as O
from hybrid_rl.hybrid.weights import iter_weight_buckets


class Phase(enum.Enum):
    TRAIN = "train"
    ROLLOUT = "rollout"
    SCORE = "score"


ALLOWED = {
    Phase.TRAIN: {Phase.ROLLOUT},
    Phase.ROLLOUT: {Phase.SCORE, Phase.TRAIN},
    Phase.SCORE: {Phase.TRAIN},
}


class PhaseError(RuntimeError):
    pass


@dataclass
class SwitchStats:
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, stage: str, seconds: float, nbytes: int = 0) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
        self.bytes[stage] = self.bytes.get(stage, 0) + nbytes


class PhaseManager:
    """Owns the residency of policy, optimizer state, reference model and engine memory."""

    def __init__(
        self,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        engine,
        device: torch.device,
        ref: Optional[torch.nn.Module] = None,
        offload_optimizer: bool = False,
        offload_ref: bool = True,
        bucket_bytes: int = 256 << 20,
    ):
        self.policy, self.optimizer, self.engine, self.ref = policy, optimizer, engine, ref
        self.device = device
        self.offload_optimizer, self.offload_ref = offload_optimizer, offload_ref
        self.bucket_bytes = bucket_bytes
        self.host = torch.device("cpu")
        self.phase = Phase.TRAIN
        self.inside: Optional[Phase] = None
        self.stats = SwitchStats()
        # The native engine bound to the policy module reads its weights in place.
        self.zero_copy = getattr(engine, "model", None) is policy
        if ref is not None and offload_ref:
            O.move_module(ref, self.host)

    # -- bookkeeping ----------------------------------------------------------
    def _transition(self, target: Phase) -> None:
        if self.inside is not None:
            raise PhaseError(f"cannot enter {target.value} while inside {self.inside.value}; leave it first")
        if target not in ALLOWED[self.phase]:
            legal = sorted(p.value for p in ALLOWED[self.phase])
            raise PhaseError(f"cannot go from {self.phase.value} to {target.value}; from {self.phase.value} go to {legal}")

    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[list[int]]:
        moved = [0]
        t0 = time.perf_counter()
        yield moved
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.add(name, time.perf_counter() - t0, moved[0])

    def pop_stats(self) -> SwitchStats:
        stats, self.stats = self.stats, SwitchStats()
        return stats

    # -- phases ---------------------------------------------------------------
    @contextlib.contextmanager
    def rollout(self) -> Iterator[object]:
        self._transition(Phase.ROLLOUT)
        with self._stage("zero_grad"):
            self.optimizer.zero_grad(set_to_none=True)
        if self.offload_optimizer:
            with self._stage("offload_optimizer") as moved:
                moved[0] = O.move_optimizer_state(self.optimizer, self.host, non_blocking=True)
        with self._stage("resume_weights"):
            self.engine.resume(["weights"])
        if not self.zero_copy:
            with self._stage("sync_weights") as moved:
                for bucket in iter_weight_buckets(self.policy, self.bucket_bytes):
                    self.engine.update_weights(bucket)
                    moved[0] += sum(t.numel() * t.element_size() for _, t in bucket)
                    del bucket  # peak extra memory: one bucket
        with self._stage("resume_kv"):
            self.engine.resume(["kv_cache"])
        self.phase, self.inside = Phase.ROLLOUT, Phase.ROLLOUT
        try:
            yield self.engine
        finally:
            with self._stage("release_engine"):
                self.engine.release(["kv_cache", "weights"])
            self.inside = None

    @contextlib.contextmanager
    def score(self) -> Iterator[Optional[torch.nn.Module]]:
        self._transition(Phase.SCORE)
        if self.ref is not None:
            with self._stage("onload_ref") as moved:
                moved[0] = O.move_module(self.ref, self.device)
        self.phase, self.inside = Phase.SCORE, Phase.SCORE
        try:
            yield self.ref
        finally:
            if self.ref is not None and self.offload_ref:
                with self._stage("offload_ref") as moved:
                    moved[0] = O.move_module(self.ref, self.host)
            self.inside = None

    @contextlib.contextmanager
    def train(self) -> Iterator[torch.optim.Optimizer]:
        self._transition(Phase.TRAIN)
        if self.offload_optimizer:
            with self._stage("onload_optimizer") as moved:
                moved[0] = O.move_optimizer_state(self.optimizer, self.device, non_blocking=True)
        self.phase, self.inside = Phase.TRAIN, Phase.TRAIN
        try:
            yield self.optimizer
        finally:
            self.inside = None
