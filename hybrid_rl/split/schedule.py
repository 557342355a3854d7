"""The split loop's protocol as a discrete-event simulation (pure, no processes).

Why: the order in which the two pools wait on each other decides both the staleness every
trained sample gets and the step time, and both can be checked here over hundreds of steps
in milliseconds, with the very functions the ranks run (`syncs_before`, `LearnerQueue`,
`StalenessRule`). The rate model (rates.py) is the closed form of this simulation's steady
state; tests hold one against the other.

Protocol (one rollout pool, one learner pool; times are per batch for the whole pool):
  rollout, before batch b: receive the syncs `syncs_before(b, v, k)` (each one waits until the
      learner has made that version), then generate batch b and send it (it lands in the queue);
  learner, step s = 1, 2, ...: take batch s - 1 from the queue (waiting for it), train, then
      broadcast version s; the broadcast is a collective, so it waits until the rollout pool
      reaches the point where it receives version s (before batch s + k) and costs `sync_s`
      on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

from hybrid_rl.split.staleness import LearnerQueue, StalenessRule, VersionedGroup, may_start
from hybrid_rl.types import Completion

Seconds = Union[float, Callable[[int], float]]


def syncs_before(batch_index: int, weights_version: int, k: int) -> list[int]:
    """The versions a rollout rank holding `weights_version` must receive, in order, before it may start
    batch `batch_index`: none if admission already allows it, else up to the oldest version that does."""
    out, v = [], weights_version
    while not may_start(batch_index, v, k):
        v += 1
        if v > batch_index:  # version b needs batch b trained first: waiting for it would deadlock
            raise RuntimeError(
                f"admission asks for version {v} before batch {batch_index}, which only exists after "
                "that batch is trained: the admission rule is broken"
            )
        out.append(v)
    return out


@dataclass
class Simulated:
    """What `simulate` measured: per learner step the lags of the trained groups and when the step
    finished (after its sync), and each pool's seconds spent waiting on the other."""

    lags: list[list[int]] = field(default_factory=list)
    dropped: int = 0
    step_end: list[float] = field(default_factory=list)
    rollout_wait_s: float = 0.0
    learner_wait_s: float = 0.0
    max_queue_depth: int = 0


def _at(t: Seconds, i: int) -> float:
    return t(i) if callable(t) else float(t)


def _group(batch: int, j: int, version: int) -> VersionedGroup:
    return VersionedGroup(
        row_index=batch * 1000 + j,
        prompt_ids=[1],
        completions=[Completion([2], [0.0], "stop")],
        rewards=[0.0],
        scores=[0.0],
        version=version,
    )


class _Run:
    """Event times of one simulated run, filled in dependency order (module docstring)."""

    def __init__(self, k: int, gen_s: Seconds, train_s: Seconds, sync_s: float):
        self.k, self.gen_s, self.train_s, self.sync_s = k, gen_s, train_s, sync_s
        self.gen_start: list[float] = []
        self.gen_end: list[float] = []
        self.batch_version: list[int] = []
        self.learn_start: list[float] = [0.0]  # index s: learner step s (1-based); 0 unused
        self.learn_end: list[float] = [0.0]
        self.sync_end: dict[int, float] = {0: 0.0}  # version -> when its broadcast finished
        self.receives_before: dict[int, int] = {}  # version -> the batch before which the rollout receives it
        self.version = 0
        self.stepping: set[int] = set()
        self.out = Simulated()

    def batch(self, b: int) -> None:
        free = start = self.gen_end[-1] if self.gen_end else 0.0
        versions = syncs_before(b, self.version, self.k)
        for v in versions:
            self.receives_before[v] = b
            self.step(v)  # the broadcast of v needs learner step v done
            start = self.sync_end[v]
            self.version = v
        self.out.rollout_wait_s += start - free - self.sync_s * len(versions)  # waiting, not syncing
        self.gen_start.append(start)
        self.gen_end.append(start + _at(self.gen_s, b))
        self.batch_version.append(self.version)

    def step(self, s: int) -> None:
        """Learner step s, then the broadcast of version s (which waits for the rollout pool's receive)."""
        if s < len(self.learn_end):
            return
        if s in self.stepping:
            raise RuntimeError(
                f"version {s} is needed to make the batch that step {s} trains: deadlock (the "
                "admission rule asks for weights that do not exist yet)"
            )
        self.stepping.add(s)
        while len(self.gen_end) < s:  # batch s - 1 must exist
            self.batch(len(self.gen_end))
        free = self.sync_end[s - 1]
        start = max(free, self.gen_end[s - 1])
        self.out.learner_wait_s += start - free
        self.learn_start.append(start)
        self.learn_end.append(start + _at(self.train_s, s - 1))
        # The rollout pool receives version s before batch s + k, i.e. after it finished batch s + k - 1.
        ready = self.gen_end[s + self.k - 1] if s + self.k - 1 < len(self.gen_end) else None
        if ready is None:
            ready = self._rollout_reaches(s)
        self.out.learner_wait_s += max(0.0, ready - self.learn_end[s])
        self.sync_end[s] = max(self.learn_end[s], ready) + self.sync_s
        self.stepping.discard(s)

    def _rollout_reaches(self, s: int) -> float:
        """When the rollout pool finishes batch s + k - 1 (generating up to it without needing version s)."""
        while len(self.gen_end) < s + self.k:
            self.batch(len(self.gen_end))  # needs versions < s only, unless admission is broken (step raises)
        return self.gen_end[s + self.k - 1]


def simulate(
    k: int,
    steps: int,
    gen_s: Seconds,
    train_s: Seconds,
    sync_s: float = 0.0,
    groups_per_step: int = 4,
    rule: StalenessRule | None = None,
) -> Simulated:
    """Run `steps` learner steps of the split loop with max staleness k; gen_s / train_s are seconds per
    batch (a number, or a function of the batch index for uneven batches). The queue and the rule are the
    library's own, so a broken admission or rejection shows in the returned lags and drops."""
    rule = rule or StalenessRule(k)
    run = _Run(k, gen_s, train_s, sync_s)
    for s in range(1, steps + 1):
        run.step(s)
    return _replay(run, steps, groups_per_step, rule)


def _replay(run: _Run, steps: int, groups_per_step: int, rule: StalenessRule) -> Simulated:
    """Feed the queue in event order: batch b lands at gen_end[b], step s takes at learn_start[s]."""
    events = [(run.gen_end[b], 0, b) for b in range(len(run.gen_end))]
    events += [(run.learn_start[s], 1, s) for s in range(1, steps + 1)]
    queue = LearnerQueue(groups_per_step * (run.k + 1))
    out = run.out
    for _, kind, i in sorted(events):  # at equal times a landing batch goes first: it is already there
        if kind == 0:
            queue.put(_group(i, j, run.batch_version[i]) for j in range(groups_per_step))
            out.max_queue_depth = max(out.max_queue_depth, len(queue))
        else:
            taken = queue.take(groups_per_step, i - 1, rule)
            out.lags.append(taken.lags)
            out.dropped += len(taken.dropped)
            out.step_end.append(run.sync_end[i])
    return out


def steady_period(sim: Simulated, warmup: int = 5) -> float:
    """Mean seconds per step after `warmup` steps (the loop's period once the pipeline is full)."""
    ends: Sequence[float] = sim.step_end
    if len(ends) <= warmup + 1:
        raise ValueError(f"need more than {warmup + 1} steps, got {len(ends)}")
    return (ends[-1] - ends[warmup]) / (len(ends) - 1 - warmup)
