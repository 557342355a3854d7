"""THE phase switch. The only place that decides what is resident in which phase.

States and the only legal moves (one training step goes round the cycle):

    TRAIN --rollout()--> ROLLOUT --score()--> SCORE --train()--> TRAIN
                            \\-----------train()-------------------/
                         ROLLOUT --reward()--> REWARD --(leave)--> ROLLOUT   (a stage nested in ROLLOUT)

to ROLLOUT: zero grads (set_to_none) -> offload optimizer state (if configured) ->
            [give back the allocator's cache] -> engine.resume(["weights"]) -> sync weights inside
            engine.begin/end_weight_update (skipped when the engine runs the policy module itself)
            (+ offload policy shards, offload.params, for engines with their own copy) ->
            [give back the allocator's cache] -> engine.resume(["kv_cache"])
leaving ROLLOUT: engine.release(["kv_cache", "weights"]) (+ onload policy shards)
to REWARD:  (inside ROLLOUT, after a round is generated) engine.release(["kv_cache"]) ->
            onload the reward model (offload.reward_model); leaving REWARD: offload it -> [give back the
            allocator's cache] -> resume the KV cache
to SCORE:   onload the reference model (and the critic's weights); leaving SCORE: offload the reference
to TRAIN:   onload optimizer state (and the critic's weights and optimizer state)
PPO's critic (critic.offload_params / critic.offload_optimizer): both leave the device on the way to ROLLOUT.

Why the reward model scores in a stage nested in ROLLOUT, not in SCORE or a phase of its own:
with dynamic sampling (loop/dynamic_sampling.py) each round's rewards decide whether another round is
generated, so the rewards of a round are needed while the engine is still live; a REWARD
phase between ROLLOUT and SCORE would wake the engine again for every extra round (a
second weight sync per round for an engine with its own copy). Nested, the engine's
weights stay (synced once per step) and only its KV cache, the rollout's largest transient,
is released, so the reward model takes the KV cache's place instead of stacking on it:
REWARD holds engine weights + reward model (+ whatever is not offloaded), never the KV cache.
A run without a reward model never enters it (rule rewards need no device memory).

[give back the allocator's cache]: only for an engine with its own memory (not the native engine decoding with
the policy): SGLang runs in other processes and vLLM allocates from its own pool, so neither can use what torch's
allocator here holds freed but cached (activations, gradients, the offloaded reference's and the sync buckets'
blocks); SGLang sizes its pool from what is free when it starts, and an out-of-memory error in its scheduler kills
the rank. So gc + synchronize + empty_cache (`memory.release_cached`) before each engine resume and after the sync,
as verl (aggressive_empty_cache) and slime do; the stage `empty_cache` counts the bytes given back. The native
engine allocates its KV cache from this same allocator, which would only have to ask the driver again.

Every stage is timed and its bytes counted into `self.stats` (drained per step), and
the memory ledger records the bytes per role at each boundary:
rollout:ready, [reward:ready per round,] rollout:generated, score:ready, train:ready, train:end.
"""

from __future__ import annotations

import contextlib
import enum
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from hybrid_rl.models.fsdp import reshard
from hybrid_rl.models.weights import engine_dtype, iter_weight_buckets
from hybrid_rl.switch import memory
from hybrid_rl.switch import offload as O
from hybrid_rl.switch.memory import MemoryLedger


class Phase(enum.Enum):
    TRAIN = "train"
    ROLLOUT = "rollout"
    REWARD = "reward"  # nested in ROLLOUT (module docstring), never a step of the cycle itself
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
    """Owns the residency of policy, optimizer state, reference and reward models, PPO's critic and its optimizer
    state, and engine memory.

    always_copy: on CPU, run the offload copies anyway (tests, the CPU benchmark).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        engine,
        device: torch.device,
        ref: Optional[torch.nn.Module] = None,
        offload_optimizer: bool = False,
        offload_ref: bool = True,
        offload_params: bool = False,
        bucket_bytes: int = 256 << 20,
        always_copy: bool = False,
        reward_model: Optional[torch.nn.Module] = None,
        offload_reward_model: bool = False,
        lora: bool = False,
        critic: Optional[torch.nn.Module] = None,
        critic_optimizer: Optional[torch.optim.Optimizer] = None,
        offload_critic: bool = False,
        offload_critic_optimizer: bool = False,
    ):
        self.policy, self.optimizer, self.engine, self.ref = policy, optimizer, engine, ref
        # PPO's critic (issue 36): its weights are used in SCORE and TRAIN, its optimizer state in TRAIN.
        self.critic, self.critic_optimizer = critic, critic_optimizer
        self.critic_offload = (
            O.ModuleOffloader(critic, device, always_copy) if critic is not None and offload_critic else None
        )
        self.critic_opt_offload = (
            O.OptimizerOffloader(critic_optimizer, device, always_copy)
            if critic_optimizer is not None and offload_critic_optimizer
            else None
        )
        self.lora = lora  # the policy carries peft adapters over a frozen base (models/lora.py)
        self.reward_model = reward_model
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.phase = Phase.TRAIN
        self.inside: Optional[Phase] = None
        self.failed_phase: Optional[Phase] = None  # where the last failed step stopped (set by recover)
        self.stats = SwitchStats()
        self.ledger = MemoryLedger(device)
        self.rollouts = 0  # rollouts begun (training and validation); labels ledger snapshots
        # The native engine bound to the policy module reads its weights in place.
        self.zero_copy = getattr(engine, "model", None) is policy
        if offload_params and self.zero_copy:
            warnings.warn("offload.params ignored: the native engine decodes with the policy's own weights")
            offload_params = False
        self.opt_offload = O.OptimizerOffloader(optimizer, device, always_copy) if offload_optimizer else None
        self.param_offload = O.ModuleOffloader(policy, device, always_copy) if offload_params else None
        self.ref_offload = O.ModuleOffloader(ref, device, always_copy) if ref is not None and offload_ref else None
        self.rm_offload = (
            O.ModuleOffloader(reward_model, device, always_copy)
            if reward_model is not None and offload_reward_model
            else None
        )
        self._policy_bytes = memory.module_bytes(policy, device)  # sharded: 1/world of the weights
        self._kv_peak = 0  # KV cache of this rollout's earlier rounds (released for each REWARD stage)
        if self.ref_offload is not None:
            self.ref_offload.offload()
        if self.rm_offload is not None:
            self.rm_offload.offload()

    # -- bookkeeping ----------------------------------------------------------
    def _transition(self, target: Phase) -> None:
        self.failed_phase = None
        if self.inside is not None:
            raise PhaseError(f"cannot enter {target.value} while inside {self.inside.value}; leave it first")
        if target not in ALLOWED[self.phase]:
            legal = sorted(p.value for p in ALLOWED[self.phase])
            raise PhaseError(
                f"cannot go from {self.phase.value} to {target.value}; from {self.phase.value} go to {legal}"
            )

    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[list[int]]:
        moved = [0]
        t0 = time.perf_counter()
        yield moved
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.add(name, time.perf_counter() - t0, moved[0])

    def _move(self, name: str, move) -> None:
        """Run one offload/onload `move` (returns the bytes it copied) as a timed, counted stage."""
        with self._stage(name) as moved:
            moved[0] = move()

    def pop_stats(self) -> SwitchStats:
        stats, self.stats = self.stats, SwitchStats()
        return stats

    def _engine_bytes(self) -> dict[str, int]:
        return self.engine.memory_bytes() if hasattr(self.engine, "memory_bytes") else {}

    def resident(self) -> dict[str, int]:
        """Bytes on the compute device per role, right now (kv_cache: peak of this rollout so far).

        An offloaded role counts as absent even on CPU, where host and device are the
        same memory: the ledger shows what the switch decided, the planner's view.
        """

        def here(offloader) -> bool:
            return offloader is None or offloader.on_device

        engine = self._engine_bytes()
        if self.inside is Phase.ROLLOUT:
            kv = max(engine.get("kv_cache", 0), self._kv_peak)
        else:
            # The native engine's figure is its last rollout's cache, freed since; an engine whose release frees
            # nothing (vLLM on CPU) says so with kv_cache_kept, and its cache counts in every phase.
            kv = engine.get("kv_cache", 0) if getattr(self.engine, "kv_cache_kept", False) else 0
        rm, critic = self.reward_model, self.critic
        critic_grads = memory.grad_bytes(critic, self.device) if critic is not None else 0
        return {
            "policy_weights": self._policy_bytes if here(self.param_offload) else 0,
            "grads": memory.grad_bytes(self.policy, self.device) + critic_grads,
            "optimizer": memory.optimizer_bytes(self.optimizer, self.device) if here(self.opt_offload) else 0,
            "engine_weights": engine.get("engine_weights", 0),
            "kv_cache": kv,
            "ref": memory.module_bytes(self.ref, self.device) if self.ref is not None and here(self.ref_offload) else 0,
            "reward_model": memory.module_bytes(rm, self.device) if rm is not None and here(self.rm_offload) else 0,
            "critic": memory.module_bytes(critic, self.device)
            if critic is not None and here(self.critic_offload)
            else 0,
            "critic_optimizer": (
                memory.optimizer_bytes(self.critic_optimizer, self.device)
                if self.critic_optimizer is not None and here(self.critic_opt_offload)
                else 0
            ),
        }

    def snapshot(self, label: str) -> None:
        self.ledger.record(label, self.rollouts, self.resident())

    # -- phases ---------------------------------------------------------------
    @contextlib.contextmanager
    def rollout(self) -> Iterator[object]:
        self._transition(Phase.ROLLOUT)
        self.rollouts += 1
        with self._stage("zero_grad"):
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad(set_to_none=True)
        if self.opt_offload is not None:
            self._move("offload_optimizer", self.opt_offload.offload)
        self._critic_off()
        self._give_back_cache()
        with self._stage("resume_weights") as moved:
            self.engine.resume(["weights"])
            # The native engine gathers the policy's shards (bytes moved); an engine with its own
            # copy only re-allocates here, and the bytes move in sync_weights.
            moved[0] = self._engine_bytes().get("engine_weights", 0) if self.zero_copy else 0
        if not self.zero_copy:
            with self._stage("sync_weights") as moved:
                moved[0] = self._sync_weights()
            if self.param_offload is not None:
                self._move("offload_params", self.param_offload.offload)
            self._give_back_cache()  # the buckets, and the shards offload.params just moved out
        with self._stage("resume_kv"):
            self.engine.resume(["kv_cache"])
        self._kv_peak = 0
        self.phase, self.inside = Phase.ROLLOUT, Phase.ROLLOUT
        self.snapshot("rollout:ready")
        try:
            yield self.engine
            self.snapshot("rollout:generated")
        finally:
            with self._stage("release_engine"):
                self.engine.release(["kv_cache", "weights"])
            if self.param_offload is not None:
                self._move("onload_params", self.param_offload.onload)
            self.inside = None

    def _critic_off(self) -> None:
        """Entering ROLLOUT: the critic's optimizer state and weights leave the device where configured."""
        if self.critic_opt_offload is not None:
            self._move("offload_critic_optimizer", self.critic_opt_offload.offload)
        if self.critic_offload is not None:
            self._move("offload_critic", self.critic_offload.offload)

    def _critic_weights_on(self) -> None:
        if self.critic_offload is not None:
            self._move("onload_critic", self.critic_offload.onload)  # a no-op when on the device

    def _give_back_cache(self) -> None:
        """Before an engine with its own memory resumes, and after the sync: the module docstring says why."""
        if self.device.type != "cuda" or self.zero_copy:
            return
        with self._stage("empty_cache") as moved:
            moved[0] = memory.release_cached(self.device)

    def _sync_weights(self) -> int:
        """Send the policy to an engine with its own copy; returns the bytes sent. Shards are cast to the engine's
        dtype before the gather (half the bytes of fp32 masters). With LoRA the frozen base goes only while the
        engine holds none (`base_synced` False: its first sync, or a wake that discarded it), and the adapters
        every time (`update_adapter`), so a step's sync is the adapters' bytes."""
        from hybrid_rl.models import lora as L

        dtype, sent = engine_dtype(self.engine), 0
        adapters = self.lora  # an engine with its own copy serves the adapter: vLLM and SGLang (update_adapter)
        if adapters and not hasattr(self.engine, "update_adapter"):
            raise PhaseError(
                f"{type(self.engine).__name__} has no adapter sync (update_adapter); model.lora.rank > 0 "
                "needs rollout.engine native, vllm or sglang"
            )
        if not (adapters and self.engine.base_synced):
            named = L.base_named_parameters(self.policy) if adapters else None
            self.engine.begin_weight_update()
            for bucket in iter_weight_buckets(self.policy, self.bucket_bytes, dtype=dtype, named=named):
                self.engine.update_weights(bucket)
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                del bucket  # peak extra memory: one bucket
            self.engine.end_weight_update()
        if adapters:
            sent += self.engine.update_adapter(
                named_tensors=L.adapter_named_tensors(self.policy, dtype), config=L.adapter_config(self.policy)
            )
        return sent

    @contextlib.contextmanager
    def reward(self) -> Iterator[torch.nn.Module]:
        """The REWARD stage, inside ROLLOUT after a round is generated: yields the resident reward model.

        Entered once per sampling round (every rank together: the forwards are FSDP collectives).
        """
        if self.reward_model is None:
            raise PhaseError("no reward model was given to the phase manager; rule rewards need no REWARD stage")
        if self.inside is not Phase.ROLLOUT:
            where = self.inside.value if self.inside is not None else f"between phases (last: {self.phase.value})"
            raise PhaseError(
                f"the reward stage runs inside the rollout phase, after a round is generated; called {where}"
            )
        # The ledger's rollout:generated reports this rollout's KV peak, which this release would hide.
        self._kv_peak = max(self._kv_peak, self._engine_bytes().get("kv_cache", 0))
        with self._stage("release_kv_for_reward"):
            self.engine.release(["kv_cache"])
        if self.rm_offload is not None:
            self._move("onload_reward_model", self.rm_offload.onload)
        self.inside = Phase.REWARD
        self.snapshot("reward:ready")
        try:
            yield self.reward_model
        finally:
            # FSDP2 keeps the root's parameters gathered after a forward (it expects a backward).
            reshard(self.reward_model)
            if self.rm_offload is not None:
                self._move("offload_reward_model", self.rm_offload.offload)
            self._give_back_cache()  # the reward model's activations (and its blocks, when offloaded)
            with self._stage("resume_kv_after_reward"):
                self.engine.resume(["kv_cache"])
            self.inside = Phase.ROLLOUT

    @contextlib.contextmanager
    def score(self) -> Iterator[Optional[torch.nn.Module]]:
        self._transition(Phase.SCORE)
        if self.ref_offload is not None:
            self._move("onload_ref", self.ref_offload.onload)
        self._critic_weights_on()  # SCORE computes the critic's values
        self.phase, self.inside = Phase.SCORE, Phase.SCORE
        self.snapshot("score:ready")
        try:
            yield self.ref
        finally:
            # FSDP2 keeps the root module's parameters gathered after a forward (it expects a
            # backward next); scoring has none, so free those gathered copies here.
            reshard(self.policy)
            if self.ref is not None:
                reshard(self.ref)
            if self.critic is not None:
                reshard(self.critic)
            if self.ref_offload is not None:
                self._move("offload_ref", self.ref_offload.offload)
            self.inside = None

    @contextlib.contextmanager
    def train(self) -> Iterator[torch.optim.Optimizer]:
        self._transition(Phase.TRAIN)
        if self.opt_offload is not None:
            self._move("onload_optimizer", self.opt_offload.onload)
        self._critic_weights_on()
        if self.critic_opt_offload is not None:
            self._move("onload_critic_optimizer", self.critic_opt_offload.onload)
        self.phase, self.inside = Phase.TRAIN, Phase.TRAIN
        self.snapshot("train:ready")
        try:
            yield self.optimizer
            self.snapshot("train:end")
        finally:
            self.inside = None

    def recover(self) -> None:
        """Back to TRAIN between steps after an exception inside one (a failing reward, an OOM, Ctrl-C).

        Each phase's `finally` has already given back what the phase held; what an exception can
        leave behind is the phase itself (ROLLOUT or SCORE, from which the next step cannot start)
        and, when it came while ROLLOUT was being entered, an engine with an open weight update or
        resumed memory, offloaded parameters, and an offloaded optimizer. All of it is put back as
        between two steps, so the next step starts cleanly. `failed_phase` keeps where it failed (the
        failure report names it) until the next phase is entered."""
        failed = self.inside or self.phase
        self.inside = None
        abort = getattr(self.engine, "abort_weight_update", None)
        if abort is not None:
            abort()
        self.engine.release(["kv_cache", "weights"])  # what is already released stays so
        if self.param_offload is not None:
            self._move("onload_params", self.param_offload.onload)  # a no-op when on the device
        if self.phase is not Phase.TRAIN:
            with self.train():  # legal from ROLLOUT and SCORE: onloads the optimizer
                pass
        else:
            if self.opt_offload is not None:
                self._move("onload_optimizer", self.opt_offload.onload)
            self._critic_weights_on()
            if self.critic_opt_offload is not None:
                self._move("onload_critic_optimizer", self.critic_opt_offload.onload)
        self.pop_stats()  # the failed step's switch time is nobody's
        self.failed_phase = failed

    @contextlib.contextmanager
    def recovering(self, undo: Callable[[], object] = lambda: None) -> Iterator[None]:
        """Around a step or a validation: on any exception, `recover()` and `undo()` (e.g. rewind the loader),
        then the exception goes on. If recovering fails too, that only warns: the first error is the one to see."""
        try:
            yield
        except BaseException:
            try:
                self.recover()
                undo()
            except Exception as err:
                warnings.warn(
                    f"could not return to TRAIN after the failure ({type(err).__name__}: {err}); build a new Trainer"
                )
            raise

    @contextlib.contextmanager
    def checkpointable(self) -> Iterator[None]:
        """Between steps: the policy and its optimizer state resident (as live DTensors) while a
        checkpoint reads or writes them, then back where the switch keeps them."""
        if self.inside is not None:
            raise PhaseError(f"cannot checkpoint inside the {self.inside.value} phase; save between steps")
        parked = [
            (name, off)
            for name, off in (
                ("optimizer", self.opt_offload),
                ("critic", self.critic_offload),
                ("critic_optimizer", self.critic_opt_offload),
            )
            if off is not None and not off.on_device
        ]
        for name, off in parked:
            self._move(f"onload_{name}", off.onload)
        try:
            yield
        finally:
            for name, off in parked:
                self._move(f"offload_{name}", off.offload)
