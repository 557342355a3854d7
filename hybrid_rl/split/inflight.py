"""In-flight weight updates of the split placement (`trainer.inflight_update`).

drain (the default): a rollout rank takes a new version only where a batch ends (rollout_loop.py `syncs_before`, the
schedule that makes a run reproducible), or with rollout.partial where its batch stops. continue: a version the
learners made is taken as soon as it exists, between two decode steps of the batch being generated, and the rows go
on decoding with it over the KV cache the older weights wrote (PipelineRL's in-flight update; SkyRL and NeMo-RL do the
same); every token is tagged with the version that sampled it (Completion.versions, then VersionedGroup's per-token
versions), so the learner's staleness rule reads a group's oldest token and the off-policy correction weighs each
token by the behaviour log-prob it was sampled with. Timing decides where a version lands, so a continue run is
not reproducible; drain is.

Why the protocol differs from drain's. A drain sync is one broadcast over the sync group (learner rank 0 + every
rollout rank): a collective, so learner rank 0 waits in it until every rollout rank reaches its receive, which the
learner can afford because it first receives every batch made before that version is needed. A version taken in
flight cannot be a collective of all the rollout ranks: one rank would wait in it mid-batch for another that is
blocked sending a batch to learner rank 0, which is itself blocked in the broadcast. So under continue:
  * each rollout rank r has its own pair group [0, r] (comm.py), and learner rank 0 one sender thread per rollout
    rank (`Offers`): after each optimizer step every learner rank gathers the weights (a collective of the learner
    mesh), learner rank 0 keeps the buckets on the host and queues them for every thread, and goes on; a thread
    writes the version under `offer_key(fit, r)` in the launcher's store (`fit`: a name learner rank 0 gives each fit()
    in its start message, so no fit reads an earlier one's offers), waits until the rank says under `want_key` that it
    entered the receive (a wait on the store, so no collective's timeout runs while a version due for validation
    waits k batches for its turn), then sends the buckets over [0, r]. The learner's
    own loop never waits for a rollout rank to take weights, so it always receives the batches they send;
  * a rollout rank's engine calls `TakeOffered.poll()` between decode steps (native: at its stop checks; vLLM: between
    engine steps): a store read (at most every POLL_S), and for each version offered beyond the one held, the receive
    over [0, r] and the engine's weight-update API. At a batch's start the blocking receives of `syncs_before` come
    through the same pair group, in the same order (every thread sends versions in order).
  * a version the fit validates is not taken in flight: it is taken before batch s + k as under drain, so each
    rollout rank validates it where the learners expect the validation (split/validation.py), and versions after it
    wait behind it.
Every version s <= the fit's last batch is sent (under drain only those a batch is made with); after its last batch
a rollout rank receives the ones it did not take. STOP (a signal) is queued like a version.
Memory: learner rank 0 holds each queued version's buckets on the host until every rollout rank took it (the gather
itself already made that copy; under drain it is freed bucket by bucket).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hybrid_rl.split.weight_sync import SyncStats, gathered_buckets, send_bucket, send_end, send_stop
from hybrid_rl.types import Completion, PartialRequest, SamplingParams, token_versions

STOP_OFFER = 1 << 62  # the store value that says the next message is STOP
# A rollout rank reads the store at most this often. A read is a round trip to the store's server (torchrun's agent,
# or rank 0's process): ~25 us on an idle node, but on the 2-core dev VM under load one per CPU decode step (1-2 ms)
# cost the rollout 12% of its time (benchmarks/inflight_split.py); a GPU decode step is 10-50 ms: every step reads.
POLL_S = 0.01


def offer_key(fit: str, rank: int) -> str:
    return f"hybrid_rl/split/offer/{fit}/{rank}"


def want_key(fit: str, rank: int, version: int) -> str:
    """Set by rollout rank `rank` as it enters the receive of `version` (or of what comes in its place: STOP)."""
    return f"hybrid_rl/split/want/{fit}/{rank}/{version}"


def new_fit_name() -> str:
    """A name no other fit() of the launcher's store has (its offers' keys)."""
    return uuid.uuid4().hex


@dataclass
class _Version:
    version: int
    buckets: list[tuple[bytes, torch.Tensor]]
    dtype: torch.dtype
    adapters: bool


class Offers:
    """Learner rank 0's senders under continue: one thread per rollout rank, each sending the queued versions in order
    over that rank's pair group. An error in a thread is raised by the next `offer` / `stop` / `finish`."""

    def __init__(self, pairs: dict[int, Any], store, timeout_s: float):
        self.pairs, self.store, self.timeout_s = pairs, store, timeout_s
        self.queues: dict[int, queue.Queue] = {}
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.fit = ""  # this fit()'s name (start())
        self.quit = threading.Event()  # this fit's threads end at their next wait (abandon())

    def start(self, fit: str) -> None:
        """A new fit(): its offers go under `fit`'s keys. Threads of an earlier fit are told to end (abandon); their
        error does not carry over."""
        self.abandon()
        self.fit, self.errors, self.threads, self.quit = fit, [], [], threading.Event()

    def abandon(self) -> None:
        """A fit that failed (not a signal: that one sends STOP): its threads end at their next wait on the store or
        their queue instead of waiting for a rollout rank that will never ask. One blocked inside a send ends at the
        pair group's timeout."""
        self.quit.set()
        for q in self.queues.values():
            q.put(None)

    def _put(self, item) -> None:
        self._raise()
        if not self.threads:  # started by a fit's first version, ended by its finish()
            self.queues = {r: queue.Queue() for r in self.pairs}
            self.threads = [threading.Thread(target=self._serve, args=(r,), daemon=True) for r in self.pairs]
            for t in self.threads:
                t.start()
        for q in self.queues.values():
            q.put(item)

    def send(self, model: torch.nn.Module, version: int, dtype: torch.dtype, bucket_bytes: int, adapters: bool):
        """Every learner rank (the gathers are collectives); learner rank 0 queues version `version` for every rollout
        rank and returns at once: the seconds are the gather's."""
        t0 = time.perf_counter()
        sender = torch.distributed.get_rank() == 0
        buckets = list(gathered_buckets(model, dtype, bucket_bytes, adapters, sender))
        if sender:
            self._put(_Version(version, buckets, dtype, adapters))
        sent = sum(flat.numel() * flat.element_size() for _, flat in buckets)
        return SyncStats(version, sent, time.perf_counter() - t0, len(buckets))

    def stop(self) -> None:
        """STOP to every rollout rank, after the versions queued before it."""
        self._put("stop")

    def finish(self) -> None:
        """Wait until every rollout rank took every queued version (the end of a fit); raise a thread's error."""
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:
            t.join()
        self.threads = []
        self._raise()

    def _raise(self) -> None:
        if self.errors:
            raise self.errors[0]

    def _serve(self, rank: int) -> None:
        """Each queued item in order: offer it, wait (on the store, not in a collective) until the rollout rank enters
        its receive, then send it. The wait: a version due for validation is taken only before its batch, k batches
        later, longer than the pair group's timeout, which then covers the transfer alone."""
        group, q, fit, quit, last = self.pairs[rank], self.queues[rank], self.fit, self.quit, 0
        while (item := q.get()) is not None and not quit.is_set():
            if self.errors:
                continue  # the run is failing: drain the queue, send nothing more
            try:
                stop = item == "stop"
                version = last + 1 if stop else item.version  # STOP comes where the next version would
                self.store.set(offer_key(fit, rank), str(STOP_OFFER if stop else version))
                while not self.store.check([want_key(fit, rank, version)]):
                    if quit.is_set():
                        return
                    time.sleep(0.002)
                if stop:
                    send_stop(src=0, group=group, timeout_s=self.timeout_s)
                    continue
                for manifest, flat in item.buckets:
                    send_bucket(manifest, flat, version, 0, group, self.timeout_s, item.adapters)
                send_end(version, item.dtype, 0, group, self.timeout_s, item.adapters)
                last = version
            except BaseException as err:  # noqa: BLE001 - raised on the learner's own thread by the next call
                self.errors.append(err)
                # Said now as well: the learner may be blocked receiving what this rollout rank can no longer make.
                traceback.print_exc(file=sys.stderr)


class TakeOffered:
    """A rollout rank's types.WeightUpdates under continue: `poll` takes every version learner rank 0 has offered to
    this rank beyond the one held, in order, except one due for validation (taken before its batch, as under drain).
    receive(v) applies version v to the engine and returns its seconds (rollout_loop.RolloutSide._receive); held() is
    the version held;
    due(v): v is validated by this fit and not yet."""

    def __init__(
        self, store, rank: int, receive: Callable[[int], Any], held: Callable[[], int], due, every_s: float = POLL_S
    ):
        """every_s: the store is read at most this often; a poll in between takes nothing (a version waits at most
        that long, against a training step's seconds between versions)."""
        self.store, self.rank, self.fit, self.key = store, rank, "", offer_key("", rank)
        self.every_s, self._read_at = every_s, -float("inf")
        self.receive, self.held, self.due = receive, held, due
        self.applied: list[int] = []  # every version taken by poll, in order
        self.seconds = 0.0  # spent receiving them

    def start(self, fit: str) -> None:
        """A new fit() (its name from the start message): only its offers count."""
        self.fit, self.key = fit, offer_key(fit, self.rank)

    def want(self, version: int) -> None:
        """This rank enters the receive of `version` (every receive under continue, blocking or in flight)."""
        self.store.set(want_key(self.fit, self.rank, version), "1")

    def offered(self) -> int:
        """The newest version offered to this rank (-1: none yet), read from the store (two round trips)."""
        return int(self.store.get(self.key)) if self.store.check([self.key]) else -1

    def poll(self) -> int:
        now = time.perf_counter()
        if now - self._read_at < self.every_s:
            return 0
        self._read_at = now
        n, newest = 0, self.offered()
        while newest > self.held() and not self.due(self.held() + 1):
            version = self.held() + 1
            self.seconds += self.receive(version)  # STOP offered: raises SyncStopped (weight_sync), ends the loop
            self.applied.append(version)
            n += 1
        return n


class InflightEngine:
    """A rollout rank's engine for its RolloutStage under continue: every generate call polls `updates` between decode
    steps, and each completion comes back with the version of each of its tokens (Completion.versions). The rest of
    the engine (its metrics, memory) is the engine's own."""

    def __init__(self, engine, updates: TakeOffered):
        self.engine, self.updates = engine, updates

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, partial: Optional[PartialRequest] = None
    ) -> list[Completion]:
        start, before = self.updates.held(), len(self.updates.applied)
        out = self.engine.generate(prompt_ids, params, partial, updates=self.updates)
        applied = self.updates.applied[before:]
        marks = getattr(self.engine, "last_update_marks", [])
        if len(marks) != len(applied):
            raise RuntimeError(
                f"the engine marked {len(marks)} weight updates, {len(applied)} were applied in its generate call"
            )
        for i, c in enumerate(out):
            c.versions = token_versions(marks, i, len(c.token_ids), start, applied)
        return out

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
