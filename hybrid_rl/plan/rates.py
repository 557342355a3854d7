"""The rate model: step time of each placement from measured rates (pure; `python -m hybrid_rl.plan --from-run`).

A step has two halves: generation (+ rule rewards) and training (scoring, advantages, the update).
Each half's seconds on n ranks:
  rollout(n) = rollout_rank_s / n + rollout_fixed_s   (rows split over n engines; the per-token decode
                                                       latency of a step does not shrink with fewer rows)
  train(n)   = train_rank_s / n + train_comm_s [n > 1] (data-parallel compute, plus the FSDP2 collectives
                                                       that a group of more than one rank pays per step)
  colocated on W ranks:  rollout(W) + train(W) + switch     (the halves take turns on every rank)
  split, R rollout ranks, W - R learner ranks, max staleness k:
      k = 0:   rollout(R) + train(W - R) + sync             (strict alternation: nothing overlaps)
      k >= 1:  max(rollout(R), train(W - R)) + sync          (the halves overlap; the slower one sets the pace)
      the faster pool idles 1 - min/max of the overlapped part.
One run measures each half at one rank count, which leaves the fixed and communication terms unknown:
they are 0 (linear data-parallel scaling) unless `fit_rates` is given runs at two rank counts (a
1-process run beside the W-rank one measures both). On 2 CPU processes the linear model was 2.1-2.5x
off for split (one learner trained the whole batch in 0.53 s, two FSDP2 ranks in 0.62 s: gloo
collectives, benchmarks/results/placement_cpu_2026-11-25.md); the two-run fit is what the benchmark
checks. On a GPU, decode is memory-bandwidth bound: its fixed term dominates, so fewer rollout ranks
with bigger batches lose less than linear scaling predicts.
split/schedule.py simulates the same protocol event by event; tests hold the two equal.

Measured rates come from a run's metrics.jsonl (hybrid_rl/observability/metrics.py names): time/rollout +
time/reward is the rollout half, time/score + time/advantage + time/train the training half (in a
colocated run also the step's unaccounted rest: logging, reductions), time/switch the colocated
switch, and the sync is split/sync_s where a split run measured it, else the colocated switch's weight
stages (switch/sync_weights_s for an engine with its own copy, switch/resume_weights_s for the native
engine's gather). A split run records split/rollout_ranks and split/world_size; a colocated run's
world size is given by the caller.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

ROLLOUT_KEYS = ("time/rollout", "time/reward")
TRAIN_KEYS = ("time/score", "time/advantage", "time/train")
SYNC_KEYS = ("split/sync_s", "switch/sync_weights_s", "switch/resume_weights_s")  # first present wins


@dataclass(frozen=True)
class Rates:
    """Per step: rank-seconds of each half, seconds of the colocated switch and of a split sync, and the
    two terms that do not scale with ranks (module docstring; 0 = linear scaling)."""

    rollout_rank_s: float
    train_rank_s: float
    switch_s: float
    sync_s: float
    rollout_fixed_s: float = 0.0
    train_comm_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rollout_rank_s", "train_rank_s", "switch_s", "sync_s", "rollout_fixed_s", "train_comm_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def rollout(self, ranks: int) -> float:
        """Seconds of the generation half on `ranks` engines."""
        return self.rollout_rank_s / ranks + self.rollout_fixed_s

    def train(self, ranks: int) -> float:
        """Seconds of the training half on a learner group of `ranks`."""
        return self.train_rank_s / ranks + (self.train_comm_s if ranks > 1 else 0.0)


@dataclass(frozen=True)
class Prediction:
    """One placement's predicted step. idle_fraction: 1 - min/max of the two halves (the faster pool's idle
    share; 0 for colocated, whose ranks never wait on another pool)."""

    placement: str  # "colocated" | "split"
    rollout_ranks: int  # R (0 for colocated)
    max_staleness: int  # k (0 for colocated: on-policy)
    rollout_s: float
    train_s: float
    overhead_s: float  # colocated: the switch; split: the sync
    step_s: float
    idle_fraction: float
    bottleneck: str  # "rollout" | "train"

    @property
    def label(self) -> str:
        return "colocated" if self.placement == "colocated" else f"split R={self.rollout_ranks} k={self.max_staleness}"


def _bottleneck(rollout_s: float, train_s: float) -> str:
    return "rollout" if rollout_s >= train_s else "train"


def idle_fraction(a: float, b: float) -> float:
    """1 - min/max: the share of its time the faster of two overlapped pools waits."""
    hi = max(a, b)
    return 0.0 if hi <= 0 else 1.0 - min(a, b) / hi


def predict_colocated(rates: Rates, world: int) -> Prediction:
    """Every rank generates then trains, paying the switch: the halves add up."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    r, t = rates.rollout(world), rates.train(world)
    return Prediction("colocated", 0, 0, r, t, rates.switch_s, r + t + rates.switch_s, 0.0, _bottleneck(r, t))


def predict_split(rates: Rates, world: int, rollout_ranks: int, k: int) -> Prediction:
    """R ranks generate, W - R train; at k = 0 they alternate, at k >= 1 they overlap (module docstring)."""
    if not 1 <= rollout_ranks < world:
        raise ValueError(f"split needs 1 <= rollout ranks < world size; got R={rollout_ranks}, world {world}")
    if k < 0:
        raise ValueError(f"max staleness must be >= 0, got {k}")
    r, t = rates.rollout(rollout_ranks), rates.train(world - rollout_ranks)
    step = (r + t if k == 0 else max(r, t)) + rates.sync_s
    return Prediction("split", rollout_ranks, k, r, t, rates.sync_s, step, idle_fraction(r, t), _bottleneck(r, t))


def predict_all(
    rates: Rates,
    world: int,
    ks: Sequence[int] = (0, 1, 2),
    tp_size: int = 1,
    placements: Sequence[str] = ("colocated", "split"),
    split_rates: Optional[Rates] = None,
) -> list[Prediction]:
    """Colocated, and split at every R in 1..W-1 that `tp_size` divides, for each k in `ks`; split from
    `split_rates` where given (`fit_placements`: measured in split runs), else from `rates`."""
    out = [predict_colocated(rates, world)] if "colocated" in placements else []
    if "split" in placements:
        sr = split_rates or rates
        out += [predict_split(sr, world, R, k) for R in range(tp_size, world, tp_size) for k in ks]
    return out


def recommend(predictions: Sequence[Prediction]) -> Prediction:
    """The fastest; among equal times the least off-policy (colocated, then smaller k), then fewer rollout ranks."""
    if not predictions:
        raise ValueError("nothing to recommend: no placement was predicted")
    return min(
        predictions, key=lambda p: (round(p.step_s, 9), p.placement != "colocated", p.max_staleness, p.rollout_ranks)
    )


def read_metrics(path: str) -> list[dict]:
    """The training-step records of a metrics.jsonl (those with time/step; validation rows have none)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "time/step" in r]
    if not steps:
        raise ValueError(f"{path} holds no training step (no record with time/step): is it a run's metrics.jsonl?")
    return steps


def _median(records: Iterable[dict], fn) -> float:
    return statistics.median(fn(r) for r in records)


def _sync_seconds(record: dict) -> float:
    return next((float(record[k]) for k in SYNC_KEYS if k in record), 0.0)


def rates_from_records(records: Sequence[dict], world: Optional[int] = None, skip: int = 1) -> tuple[Rates, dict]:
    """Rates (medians over the steps after the first `skip`, which pay one-off costs) and what the run was:
    {"world", "rollout_ranks", "steps"}. world: the run's ranks, needed for a colocated run (a split run
    records split/world_size)."""
    recs = list(records[skip:]) if len(records) > skip else list(records)
    if not recs:
        raise ValueError("no step records to read rates from")
    R = int(recs[0].get("split/rollout_ranks", 0))
    W = int(recs[0].get("split/world_size", world or 0))
    if W < 1:
        raise ValueError(
            "the run's world size is unknown: a colocated run's metrics do not record it; pass it (--run-gpus)"
        )
    rollout = _median(recs, lambda r: sum(float(r.get(k, 0.0)) for k in ROLLOUT_KEYS))
    train = _median(recs, lambda r: sum(float(r.get(k, 0.0)) for k in TRAIN_KEYS))
    switch = _median(recs, lambda r: float(r.get("time/switch", 0.0)))
    sync = _median(recs, _sync_seconds)
    if R == 0:
        # The step's rest (logging, reductions) runs once per step: bill it to the half that stays.
        rest = _median(
            recs,
            lambda r: (
                float(r["time/step"]) - sum(float(r.get(k, 0.0)) for k in ROLLOUT_KEYS + TRAIN_KEYS + ("time/switch",))
            ),
        )
        rates = Rates(rollout * W, (train + max(0.0, rest)) * W, switch, sync)
    else:
        rates = Rates(rollout * R, train * (W - R), switch, sync)
    return rates, {"world": W, "rollout_ranks": R, "steps": len(recs)}


def _fit_inverse(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, c) of t = a / n + c with a, c >= 0, least squares over (n, t) points; one rank count: (n t, 0).
    On the boundary: c < 0 unconstrained (2 ranks more than twice as fast: noise, or super-linear) keeps
    the best c = 0 line; a < 0 (more ranks no faster: latency-bound decode) keeps the best a = 0 one, a
    constant. The model never predicts a speed-up from more rows per rank, nor a slow-down from fewer."""
    xs = [1.0 / n for n, _ in points]
    ts = [t for _, t in points]
    if len(set(xs)) < 2:
        return statistics.mean(n * t for n, t in points), 0.0
    mx, mt = statistics.mean(xs), statistics.mean(ts)
    a = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    c = mt - a * mx
    if a < 0:
        return 0.0, mt
    if c < 0:
        return sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs), 0.0
    return a, c


def _pool_points(runs: Sequence[tuple[Rates, dict]]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Each run's (ranks, seconds) of generation and of training: a colocated run's W ranks do both, a split
    run's R rollout ranks generate and W - R learners train."""
    roll, train = [], []
    for rates, meta in runs:
        W, R = meta["world"], meta["rollout_ranks"]
        r_n, t_n = (W, W) if R == 0 else (R, W - R)
        roll.append((r_n, rates.rollout(r_n)))
        train.append((t_n, rates.train(t_n)))
    return roll, train


def fit_rates(runs: Sequence[tuple[Rates, dict]]) -> Rates:
    """One Rates from runs at one or more rank counts (each `rates_from_records`' pair).

    rollout: `_fit_inverse` over every run's (rollout ranks, seconds). train: a learner group of one rank
    pays no collective, so 1-rank points give train_rank_s and the larger groups' excess over it is
    train_comm_s; without a 1-rank point, `_fit_inverse`. The switch is the largest colocated run's (the
    planned layout's nearest), the sync a split run's where one measured it, else the largest switch's."""
    if not runs:
        raise ValueError("no run to read rates from")
    roll, train = _pool_points(runs)
    a_r, c_r = _fit_inverse(roll)
    ones = [t for n, t in train if n == 1]
    if ones and len({n for n, _ in train}) > 1:
        a_t = statistics.mean(ones)
        c_t = max(0.0, statistics.mean(t - a_t / n for n, t in train if n > 1))
    else:
        a_t, c_t = _fit_inverse(train)
    colocated = [(meta["world"], rates) for rates, meta in runs if meta["rollout_ranks"] == 0]
    split = [rates for rates, meta in runs if meta["rollout_ranks"] > 0]
    switch_src = max(colocated, key=lambda wr: wr[0])[1] if colocated else runs[0][0]
    sync = split[0].sync_s if split else switch_src.sync_s
    return Rates(a_r, a_t, switch_src.switch_s, sync, rollout_fixed_s=c_r, train_comm_s=c_t)


def _anchored(points: Sequence[tuple[int, float]], fixed: float, at_one: bool) -> tuple[float, float]:
    """(a, c) from points at one rank count, keeping the term `fixed` another fit measured (c <= t);
    at_one: the term is not paid by a group of one rank (training's collectives). More counts: fitted."""
    if len({n for n, _ in points}) > 1:
        return _fit_inverse(points)
    n = points[0][0]
    t = statistics.mean(t for _, t in points)
    if at_one and n == 1:
        return t, fixed  # a 1-rank group measured the whole compute and paid none of the term
    c = min(fixed, t)
    return (t - c) * n, c


def fit_placements(runs: Sequence[tuple[Rates, dict]]) -> tuple[Rates, Optional[Rates]]:
    """(rates for colocated, rates for split or None). Colocated: `fit_rates` over the colocated runs. Split:
    where split runs were measured, each pool's rate as a split process ran it (on the 2-core CPU a split
    process ran each half 10-25% slower than one colocated process did, which colocated runs cannot show;
    benchmarks/results/placement_two_run_fit_cpu_2026-11-25.md), keeping the fixed and collective terms
    of the colocated fit where the split runs measured one rank count only. The sync is the split runs'."""
    colocated = [r for r in runs if r[1]["rollout_ranks"] == 0]
    split = [r for r in runs if r[1]["rollout_ranks"] > 0]
    base = fit_rates(colocated or runs)
    if not split:
        return base, None
    roll, train = _pool_points(split)
    a_r, c_r = _anchored(roll, base.rollout_fixed_s, at_one=False)
    a_t, c_t = _anchored(train, base.train_comm_s, at_one=True)
    sync = statistics.median(r.sync_s for r, _ in split)
    return base, Rates(a_r, a_t, base.switch_s, sync, rollout_fixed_s=c_r, train_comm_s=c_t)
