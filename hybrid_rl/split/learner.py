"""The learner ranks' side of a split step: the batch to train, and what follows the update.

Step s (1-based) trains batch s - 1 and makes version s (staleness.py). `batch` hands the Trainer the
RolloutBatch of batch s - 1 (learner rank 0 receives it, takes it from the queue under the StalenessRule,
and scatters equal shares over the learner ranks); the Trainer then runs its own SCORE -> ADVANTAGE ->
TRAIN code on it, the colocated code, unchanged. `after_update` receives the batches the rollout ranks
make before they need version s (up to s + k - 1: generated while this step trained, which is the overlap)
and then sends version s, if a batch of this fit() will be made with it.

Wait times: `split/learner_wait_s` is the learner's time blocked on the rollout ranks (a batch not there
yet); `split/rollout_wait_s` the rollout ranks' time blocked on weights before the batch trained now.

Stopping early (a signal on any rank; rollout_loop.py): `signal` is the one a rollout rank reported with the
batch trained now (the same on every learner rank: it travels with the scattered metrics); after the
checkpoint `stop` receives the batches the rollout ranks can still make with the weights they hold, so
none is left blocked in a send, and sends STOP where they wait for the next weights.

Carried with each batch's report (as the loader's position is): the reward normaliser's state after the batch
(reward.normalize_model: it updates on the rollout ranks). `batch` loads both into the run state when it trains
that batch, so the checkpoint of step s holds the state after batch s - 1, not after the batches generated
ahead (k > 0), and `start` sends both back to the rollout ranks. Validation: `validate` (split/validation.py).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from hybrid_rl.batch import RolloutBatch
from hybrid_rl.observability.metrics import StageTimer
from hybrid_rl.plan.rates import idle_fraction
from hybrid_rl.runtime import distributed as D
from hybrid_rl.split.comm import SplitComm, start_message
from hybrid_rl.split.groups import to_rollout_batch
from hybrid_rl.split.inflight import Offers, new_fit_name
from hybrid_rl.split.staleness import LearnerQueue, StalenessRule, Taken, staleness_metrics
from hybrid_rl.split.transport import recv_groups, recv_json
from hybrid_rl.split.validation import validation_steps, validation_syncs
from hybrid_rl.split.weight_sync import send_stop, send_weights

ROLLOUT_TIMES = ("time/rollout", "time/reward")


class LearnerSide:
    def __init__(
        self,
        comm: SplitComm,
        rule: StalenessRule,
        prompts_per_step: int,
        rows: Sequence[dict],
        pad_id: int,
        device: torch.device,
        sync_dtype: torch.dtype,
        bucket_bytes: int,
        loader,
        adapters: bool = False,
        val_every: int = 0,
        val_before_train: bool = False,
        schedule_k: Optional[int] = None,
        inflight: bool = False,
    ):
        """prompts_per_step: data.batch_size (the queue holds k + 1 steps of groups); rows: the dataset the
        rollout ranks draw from (a group carries its row's index); loader: the run state's PromptLoader, kept at
        the rollout ranks' position after the batch last trained (what a checkpoint saves); adapters: LoRA, the
        syncs send the adapters only; val_every, val_before_train: trainer.val_every / val_before_train; schedule_k:
        how many versions ahead the rollout ranks run (the admission schedule; default the rule's k, and k - 1
        with rollout.partial, so that a group carried over one batch is still within k: roles.schedule_k); inflight:
        trainer.inflight_update=continue, versions go out through split/inflight.py's sender threads."""
        self.comm, self.rule, self.rows, self.pad_id, self.device = comm, rule, rows, pad_id, device
        self.loader, self.reward_norm = loader, None  # the run state's RunningNorm, given by start()
        self.sync_dtype, self.bucket_bytes, self.adapters = sync_dtype, bucket_bytes, adapters
        self.val_every, self.val_before_train = val_every, val_before_train
        self.val_steps: list[int] = []  # this fit()'s validated steps, and the versions sent for them alone
        self.val_syncs: list[int] = []
        self.k = rule.max_staleness if schedule_k is None else schedule_k
        self.queue = LearnerQueue(prompts_per_step * (self.k + 1))
        self.partial: Optional[CarriedSamples] = None  # rollout.partial: the run state's, given by start()
        self.meta: dict[int, dict] = {}  # batch index -> what the rollout ranks reported with it
        self.sizes: dict[int, int] = {}  # batch index -> groups it holds
        self.next_batch = 0  # the next batch to receive
        self._trained_tokens = 0.0
        self.last_batch = -1
        self.signal = 0  # a signal a rollout rank reported (the fit loop stops on it as on its own)
        self.offers = Offers(comm.pairs, D.store(), comm.timeout_s) if inflight else None

    def start(
        self,
        first_batch: int,
        n_batches: int,
        loader_state: dict,
        policy: torch.nn.Module,
        reward_norm=None,
        partial: Optional["CarriedSamples"] = None,
    ) -> None:
        """The start of a fit(): tell the rollout ranks the batches to make, their loader position and the reward
        normaliser's state (`reward_norm`: the run state's RunningNorm, or None; batch() keeps it current); a run
        that does not start at batch 0 (resumed, or a second fit) first sends its weights, version `first_batch`,
        and so does a LoRA run at batch 0 (the adapters' initial draw is learner rank 0's)."""
        self.next_batch, self.last_batch = first_batch, first_batch + n_batches - 1
        self.reward_norm, self.partial = reward_norm, partial
        self.val_steps = validation_steps(first_batch, self.last_batch, self.val_every, self.val_before_train)
        # Under continue every version up to the last batch is sent anyway (inflight.py): only later ones go alone.
        self.val_syncs = validation_syncs(self.val_steps, self.last_batch, 0 if self.offers else self.k)
        self.queue.clear()  # nothing is in flight between two fit() calls (the last batch was trained)
        if D.rank() == 0:
            norm = reward_norm.state_dict() if reward_norm is not None else None
            carried = partial.states if partial is not None else None
            fit = new_fit_name()
            if self.offers is not None:
                self.offers.start(fit)
            start_message(self.comm, first_batch, self.last_batch, loader_state, norm, carried, fit)
        if first_batch > 0 or self.adapters:
            self._send(policy, first_batch)

    def batch(self, finished_steps: int, timer: StageTimer) -> tuple[Optional[RolloutBatch], dict]:
        """This learner rank's share of batch `finished_steps` as a RolloutBatch (None when it holds no group),
        and the step's rollout-side metrics (the rollout ranks' stage seconds go into `timer`, so the step's
        time metrics carry them); collective over the learner ranks."""
        b = finished_steps
        shares, info = None, None
        if D.rank() == 0:
            wait = self._receive_through(b)
            taken = self.queue.take(self.sizes.pop(b), b, self.rule)
            kept = taken.kept[: len(taken.kept) - len(taken.kept) % self.comm.n_learners]  # equal shares
            per = len(kept) // self.comm.n_learners
            shares = [kept[i * per : (i + 1) * per] for i in range(self.comm.n_learners)]
            info = self._metrics(b, taken, wait)
            shares = [(s, info) for s in shares]
        groups, info = D.scatter_object_from(shares, 0)
        info = dict(info)
        self.loader.load_state_dict(info.pop("split/loader"))
        norm = info.pop("split/reward_norm")
        if self.reward_norm is not None:  # the state after batch b: what the checkpoint of step b + 1 holds
            self.reward_norm.load_state_dict(norm)
        carried = info.pop("split/partial")
        if self.partial is not None:  # each rollout rank's carried samples after batch b: the checkpoint's
            self.partial.states = carried
        self.signal = max(self.signal, int(info.pop("split/signal")))
        for k in ROLLOUT_TIMES:
            timer.seconds[k] = info.pop(k)
        batch = to_rollout_batch(groups, self.rows, self.pad_id, self.device) if groups else None
        return batch, info

    def after_update(self, policy: torch.nn.Module, version: int, batch: Optional[RolloutBatch]) -> dict[str, float]:
        """After the optimizer step that made `version` (on `batch`): receive ahead, then send the weights (every
        learner rank calls it: the gathers are collectives of the learner mesh)."""
        tokens = torch.tensor([float(batch.resp_mask_NT.sum()) if batch is not None else 0.0], dtype=torch.float64)
        self._trained_tokens = D.all_reduce_sum(tokens).item()
        out = {"split/sync_s": 0.0, "split/sync_bytes": 0.0}
        if self.offers is not None and version <= self.last_batch:  # continue: offered at once, taken in flight
            stats = self._send(policy, version)
            out.update({"split/sync_s": stats.seconds, "split/sync_bytes": float(stats.bytes)})
        wait = self._receive_through(min(version + self.k - 1, self.last_batch)) if D.rank() == 0 else 0.0
        out["split/learner_wait_s"] = wait
        if self.offers is None and version + self.k <= self.last_batch:  # drain: a batch of this fit() is made with it
            stats = self._send(policy, version)
            out.update({"split/sync_s": stats.seconds, "split/sync_bytes": float(stats.bytes)})
        return out

    def stop(self, step: int) -> None:
        """fit() stops after `step` (a signal): on learner rank 0, receive what the rollout ranks make with the
        weights they hold (batches through step + k, version `step` was sent if one of them is in this fit),
        then send STOP if they would wait for version step + 1."""
        if D.rank() != 0:
            return
        k = self.k
        self._receive_through(min(step + k, self.last_batch))
        # They wait for version step + 1: before batch step + k + 1 (drain), or after their last batch (continue).
        waits = step + (1 if self.offers is not None else k + 1) <= self.last_batch
        if waits or any(s > step for s in self.val_syncs):
            if self.offers is not None:
                self.offers.stop()
            else:
                send_stop(src=0, group=self.comm.sync_group, timeout_s=self.comm.timeout_s)
        self.finish()
        self.queue.clear()

    def finish(self) -> None:
        """The end of a fit(): under continue, wait until every rollout rank took the versions queued for it."""
        if self.offers is not None and D.rank() == 0:
            self.offers.finish()

    def abandon(self) -> None:
        """A fit() that failed (not a signal): under continue, learner rank 0's sender threads end now."""
        if self.offers is not None and D.rank() == 0:
            self.offers.abandon()

    def validate(self, policy: torch.nn.Module, write_samples, step: int) -> dict[str, float]:
        """fit()'s validation of version `step` (after that step; 0: before training), which the rollout ranks run
        once they hold it (split/validation.py); a version no batch of this fit() is made with is sent for it now
        (every learner rank: the gathers are collectives). Learner rank 0 receives the val/* metrics, tagged with
        val/weights_version, and passes the first rollout rank's sample records to `write_samples`; every learner
        rank returns the metrics."""
        if step not in self.val_steps:
            raise RuntimeError(
                f"validation after step {step} is not in this fit's schedule {self.val_steps}: fit() and the "
                "split validation schedule disagree"
            )
        if step in self.val_syncs:
            self._send(policy, step)
        metrics = None
        if D.rank() == 0:
            t0, reports = time.perf_counter(), []
            for src in self.comm.layout.rollouts:
                peer = self.comm.layout.role(src)
                reports.append(recv_json(src, self.comm.timeout_s, peer=peer))
                if reports[-1]["val_step"] != step:
                    raise RuntimeError(
                        f"{peer} sent the validation of step {reports[-1]['val_step']}, expected step {step}: "
                        "the ranks disagree on the validation schedule"
                    )
            first = reports[0]  # the metrics are reduced over the rollout pool: the same on each
            metrics = {
                **first["metrics"],
                "val/weights_version": float(first["version"]),
                "val/wait_s": time.perf_counter() - t0,
            }
            write_samples(first["samples"])
        return D.broadcast_object_from(metrics, 0)

    def _send(self, policy: torch.nn.Module, version: int):
        if self.offers is not None:
            return self.offers.send(policy, version, self.sync_dtype, self.bucket_bytes, self.adapters)
        return send_weights(
            policy,
            version,
            src=0,
            group=self.comm.sync_group,
            dtype=self.sync_dtype,
            bucket_bytes=self.bucket_bytes,
            timeout_s=self.comm.timeout_s,
            adapters=self.adapters,
        )

    def _receive_through(self, last: int) -> float:
        """On learner rank 0: receive every batch up to `last` not received yet, each from every rollout rank in
        rank order (deterministic); returns the seconds spent waiting."""
        t0 = time.perf_counter()
        while self.next_batch <= last:
            b, reports, n = self.next_batch, [], 0
            for src in self.comm.layout.rollouts:
                peer = self.comm.layout.role(src)
                groups, _ = recv_groups(src, self.comm.timeout_s, peer=peer)
                reports.append(recv_json(src, self.comm.timeout_s, peer=peer))
                if reports[-1]["batch"] != b:
                    raise RuntimeError(
                        f"{peer} sent batch {reports[-1]['batch']}, expected batch {b}: the ranks "
                        "disagree on the schedule"
                    )
                self.queue.put(groups)
                n += len(groups)
            self.meta[b], self.sizes[b] = _merge(reports), n
            self.next_batch += 1
        return time.perf_counter() - t0

    def _metrics(self, b: int, taken: Taken, wait: float) -> dict:
        """The rollout side's metrics of batch b (reward, sampling, its stage seconds), the staleness of what is
        trained, and the tokens generated per second of generation."""
        meta = self.meta.pop(b)
        out = dict(meta["metrics"])
        out.update(staleness_metrics(taken, len(self.queue)))
        out.update({k: meta[k] for k in ROLLOUT_TIMES})
        out.update(
            {
                "split/rollout_wait_s": meta["wait_s"],
                "split/batch_wait_s": wait,
                "split/generated_tokens": float(meta["tokens"]),
                "split/tokens_generated_per_s": meta["tokens"] / max(meta["time/rollout"], 1e-9),
                "split/weights_version": float(meta["version"]),
                "split/inflight_updates": float(meta["inflight_updates"]),
                "split/inflight_sync_s": meta["inflight_sync_s"],
                "split/loader": meta["loader"],
                "split/reward_norm": meta["reward_norm"],
                "split/partial": meta["partial"],
                "split/signal": meta["signal"],
            }
        )
        return out

    def rates(self, metrics: dict) -> dict:
        """Per-step rates and the bottleneck line, once the step's times are known."""
        lay = self.comm.layout
        return finish_metrics(metrics, self._trained_tokens, lay.world_size, lay.rollout_ranks)


def _merge(reports: list[dict]) -> dict:
    """One report per batch: the first rollout rank's metrics, loader and reward normaliser (reduced over the
    rollout pool, the same on each), the slowest rank's seconds, the sum of the tokens."""
    out = dict(reports[0])
    for k in (*ROLLOUT_TIMES, "wait_s"):
        out[k] = max(r[k] for r in reports)
    out["tokens"] = sum(r["tokens"] for r in reports)
    out["inflight_updates"] = sum(r.get("inflight_updates", 0) for r in reports)
    out["inflight_sync_s"] = max(r.get("inflight_sync_s", 0.0) for r in reports)
    out["signal"] = max(r.get("signal", 0) for r in reports)
    out["partial"] = [r["partial"] for r in reports] if reports[0].get("partial") is not None else None
    return out


class CarriedSamples:
    """rollout.partial in the split placement, on the learners: each rollout rank's carried samples (its pool's
    state, loop/partial.py) as of the batch last trained. The run state saves it in the rank file; the start
    message sends it back, so a resumed run's rollout ranks continue the same samples."""

    def __init__(self) -> None:
        self.states: Optional[list[dict]] = None  # in rollout-rank order; None before the first batch

    def state_dict(self) -> dict:
        return {"rollout_ranks": self.states}

    def load_state_dict(self, state: dict) -> None:
        if "rollout_ranks" not in state:
            raise ValueError(
                "holds a colocated run's carried samples; this run is split (trainer.placement): resume it colocated"
            )
        self.states = state["rollout_ranks"]

    def carried_samples(self) -> int:
        return sum(len(g["samples"]) for st in self.states or [] for g in st["groups"])


def finish_metrics(metrics: dict, trained_tokens: float, world: int, rollout_ranks: int) -> dict:
    """Tokens trained per second and the bottleneck line: which pool limits the loop and how much of its time
    the other idles (rates.idle_fraction)."""
    gen_s = metrics.get("time/rollout", 0.0) + metrics.get("time/reward", 0.0)
    train_s = sum(metrics.get(k, 0.0) for k in ("time/score", "time/advantage", "time/train"))
    slower = "rollout" if gen_s >= train_s else "learner"
    other = "learners" if slower == "rollout" else "rollout ranks"
    return {
        "split/tokens_trained_per_s": trained_tokens / max(train_s, 1e-9),
        "split/rollout_ranks": float(rollout_ranks),
        "split/world_size": float(world),
        "split/bottleneck": f"{slower}-bound: {other} idle {100 * idle_fraction(gen_s, train_s):.0f}%",
    }


class NoEngine:
    """The split learners' engine: nothing to hold, load or free (their ROLLOUT phase only receives the batch),
    so the phase switch's bookkeeping runs unchanged and moves nothing. Generating here is a wiring bug."""

    def __init__(self, policy: torch.nn.Module):
        self.model = policy  # the switch then treats it as zero-copy: no weight sync

    def resume(self, tags) -> None:
        """Nothing is ever released."""

    def release(self, tags) -> None:
        """Nothing is resident."""

    def memory_bytes(self) -> dict[str, int]:
        return {}

    def generate(self, prompt_ids, params):
        raise RuntimeError(
            "a split learner rank does not generate (trainer.placement=split): validation and rollouts run on "
            "the rollout ranks (LearnerSide.validate receives the validation's metrics)"
        )
