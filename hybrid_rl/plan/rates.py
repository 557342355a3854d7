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

Partial rollouts (`rollout.partial`, loop/partial.py; colocated only). A step's rollout half R splits into a body
and a tail: the tail t = tau R is the seconds during which fewer than half of the engine's rows were still decoding
(time/rollout_tail; its share tau is taken to hold at every rank count), the body b = R - t (rule rewards included).
Partial rollouts keep ceil(over x batch) groups in flight (rollout.partial_over) and stop once the batch's groups are
done; what is unfinished is carried and continued in the next step. The model, per step in steady state:
  cut share   x = min(1, 2 - 2 / over): the share of the tail cut. Rows stand for groups (a group's samples end
              together) and carried samples' head start is ignored: rows fall from all to half over the body and
              from half to none over the tail, linearly, so the batch (1 / over of the rows in flight) is done
              2 / over - 1 of the way into the tail. over = 1 cuts nothing; over >= 2 cuts the whole tail. Also
              ignored: the room carried long groups take in flight (about p x L x batch, with a share p of long
              answers L times the short ones), which makes x optimistic where over - 1 is not well above p x L
              (docs/partial_rollouts.md, "Sizing").
  decode      each decode step costs l + c x rows: a latency share lam of it is the same whatever the rows, the
              rest is per token. Cutting the tail saves its latency, lam x t; its tokens are carried and decoded
              in the next step's body at the body's per-token cost, (1 - lam) x t (a step decodes, on average,
              the tokens it trains: over-provisioning raises the rows of each decode step, not the tokens).
              lam = 1 (--decode latency): decode steps cost the same whatever their rows; lam = 0 (throughput):
              time is proportional to rows, the tail is no slower per token than the body and cutting it saves
              nothing. Default: lam = rollout_fixed_s / rollout(W), the share of generation that fewer rows per
              rank do not save, where two rank counts measured one (or --rollout-fixed-s gave it), else 0. The
              tail's true latency share is higher than the rollout's (fewer rows), so lam under-counts the saving.
  re-prefill  each carried row is re-prefilled (prompt + prefix) in the next step: (over - 1) x the batch's rows,
              each with a prefix of about the body's decode steps, = rho = 4 / 3 x (over - 1) of the body's tokens
              (rows average 3/4 of the batch over the body), at the body's per-token cost: p x (1 - lam) x rho x b.
              Prefill runs many tokens per forward, so it pays the per-token part only, and p (--prefill-cost,
              default 1) scales that: 1 is an upper bound (a decode row's per-token cost also reads its KV cache),
              0 a run that re-prefills nothing: the native engine with rollout.partial_kv=keep (one forward of each
              carried row's last token), or a prefix cache that holds every carried prefix. The prompt and the
              prefix's tail steps are left out.
  R_partial = R - lam x t + p x (1 - lam) x rho x b;  the training half and the switch are unchanged (same batch).
rollout.partial_stop = 1 is assumed (every step trains a full batch). From a run that had rollout.partial on
(rollout/carried in its records) the measured rollout is R_partial, and R = R_partial / f with f the ratio above
(`partial_rollout_ratio`): its tail was cut, so the tail share of a rollout without partial must be given (--tail-frac).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

ROLLOUT_KEYS = ("time/rollout", "time/reward")
TAIL_KEY = "time/rollout_tail"  # -1: the engine did not measure it
PARTIAL_KEY = "rollout/carried"  # logged only by the steps of a run with rollout.partial on
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


def _steps(records: Sequence[dict], skip: int) -> list[dict]:
    """The steps after the first `skip` (one-off costs), or all of them when there are no more."""
    recs = list(records[skip:]) if len(records) > skip else list(records)
    if not recs:
        raise ValueError("no step records to read rates from")
    return recs


def _median(records: Iterable[dict], fn) -> float:
    return statistics.median(fn(r) for r in records)


def _sync_seconds(record: dict) -> float:
    return next((float(record[k]) for k in SYNC_KEYS if k in record), 0.0)


def rates_from_records(records: Sequence[dict], world: Optional[int] = None, skip: int = 1) -> tuple[Rates, dict]:
    """Rates (medians over the steps after the first `skip`, which pay one-off costs) and what the run was:
    {"world", "rollout_ranks", "steps"}. world: the run's ranks, needed for a colocated run (a split run
    records split/world_size)."""
    recs = _steps(records, skip)
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


# -- partial rollouts (module docstring) ------------------------------------------------------------------------
DECODE_MODES = ("fit", "latency", "throughput")


def ran_partial(records: Sequence[dict], skip: int = 1) -> bool:
    """Whether a run's steps (after `skip`, as `rates_from_records` reads them) had rollout.partial on."""
    flags = {PARTIAL_KEY in r for r in _steps(records, skip)}
    if len(flags) > 1:
        raise ValueError(
            f"its steps mix rollout.partial on and off ({PARTIAL_KEY} in some records only): give a run's steps of "
            "one setting"
        )
    return flags.pop()


def tail_share_from_records(records: Sequence[dict], skip: int = 1) -> float:
    """tau: the median over the steps after `skip` of time/rollout_tail / (time/rollout + time/reward), the tail's
    share of the rollout half as `rates_from_records` measures it."""
    shares = []
    for r in _steps(records, skip):
        step = r.get("step", "?")
        tail = r.get(TAIL_KEY)
        if tail is None or float(tail) == -1.0:
            raise ValueError(
                f"--partial needs the rollout's tail ({TAIL_KEY}), which step {step} lacks (an engine that does not "
                "measure it logs -1, runs before partial rollouts log nothing): give --tail-frac or --rollout-tail-s"
            )
        tail, gen = float(tail), float(r.get("time/rollout", 0.0))
        if tail < 0 or gen < 0:
            raise ValueError(f"step {step}: {TAIL_KEY} {tail} and time/rollout {gen} must be >= 0")
        if tail > gen:
            raise ValueError(
                f"step {step}: {TAIL_KEY} {tail} s is longer than time/rollout {gen} s (a tail is part of its rollout)"
            )
        half = sum(float(r.get(k, 0.0)) for k in ROLLOUT_KEYS)
        shares.append(tail / half if half > 0 else 0.0)
    return statistics.median(shares)


def decode_latency_share(rates: Rates, world: int, decode: str = "fit") -> float:
    """lam: the share of a decode step's cost that does not grow with its rows. latency: 1, throughput: 0, fit: the
    rates' fixed generation term over the rollout half on `world` ranks (0 where none was measured)."""
    if decode not in DECODE_MODES:
        raise ValueError(f"--decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
    if decode != "fit":
        return 1.0 if decode == "latency" else 0.0
    total = rates.rollout(world)
    return rates.rollout_fixed_s / total if total > 0 else 0.0


def tail_cut_share(over: float) -> float:
    """x: the share of the tail a partial rollout cuts with `over` x the batch's groups in flight."""
    return min(1.0, 2.0 - 2.0 / over)


def reprefill_ratio(over: float) -> float:
    """rho: the carried rows' prefix tokens re-prefilled per step, over the body's decoded tokens."""
    return 4.0 / 3.0 * (over - 1.0)


def partial_rollout_ratio(tail_share: float, over: float, latency_share: float, prefill_cost: float = 1.0) -> float:
    """R_partial / R: the rollout half with partial rollouts over the one without."""
    lam, rho = latency_share, reprefill_ratio(over)
    return 1.0 - lam * tail_cut_share(over) * tail_share + prefill_cost * (1.0 - lam) * rho * (1.0 - tail_share)


@dataclass(frozen=True)
class PartialPrediction:
    """The colocated step without and with rollout.partial (seconds per step) and the terms between them: the tail,
    the part of it cut, what cutting saves (its latency), and what the carried work costs in the next step's body
    (decoding the cut tokens, re-prefilling the carried prefixes). measured: which side the rates were read on."""

    measured: str  # "without" | "with"
    decode: str  # DECODE_MODES
    latency_share: float  # lam
    tail_share: float  # tau
    over: float
    tail_cut_share: float  # x
    reprefill_ratio: float  # rho
    prefill_cost: float  # p
    rollout_without_s: float
    rollout_with_s: float
    tail_s: float
    tail_cut_s: float
    saved_s: float  # lam x t: the cut tail's latency
    carried_decode_s: float  # (1 - lam) x t
    reprefill_s: float  # p (1 - lam) rho b
    step_without_s: float
    step_with_s: float
    net_saving_s: float
    speedup: float


def predict_partial(
    colocated: Prediction,
    tail_share: float,
    over: float = 1.5,
    latency_share: float = 0.0,
    measured: str = "without",
    decode: str = "fit",
    prefill_cost: float = 1.0,
) -> PartialPrediction:
    """The colocated step with and without partial rollouts (module docstring), from `colocated` as the rates
    predict it: a step without partial rollouts (measured="without"), or with them (a run with rollout.partial on;
    tail_share is then the share a rollout without partial would have)."""
    if colocated.placement != "colocated":
        raise ValueError("partial rollouts run in the colocated placement only")
    if not 0 <= tail_share < 1:
        raise ValueError(f"the tail's share of the rollout must be in [0, 1), got {tail_share}")
    if not over >= 1:
        raise ValueError(f"--partial-over (rollout.partial_over) must be >= 1, got {over}")
    if not 0 <= latency_share <= 1:
        raise ValueError(f"the decode latency share must be in [0, 1], got {latency_share}")
    if not 0 <= prefill_cost <= 1:
        raise ValueError(f"--prefill-cost must be in [0, 1], got {prefill_cost}")
    if measured not in ("without", "with"):
        raise ValueError(f"measured must be 'without' or 'with', got {measured!r}")
    rollout = colocated.rollout_s
    if measured == "with":
        rollout /= partial_rollout_ratio(tail_share, over, latency_share, prefill_cost)
    rest = colocated.step_s - colocated.rollout_s  # training half + switch: the same batch trains either way
    tail = tail_share * rollout
    cut, rho = tail_cut_share(over), reprefill_ratio(over)
    tail_cut = cut * tail
    carried = (1.0 - latency_share) * tail_cut
    reprefill = prefill_cost * (1.0 - latency_share) * rho * (rollout - tail)
    with_partial = rollout - tail_cut + carried + reprefill
    step_without, step_with = rollout + rest, with_partial + rest
    return PartialPrediction(
        measured,
        decode,
        latency_share,
        tail_share,
        over,
        cut,
        rho,
        prefill_cost,
        rollout,
        with_partial,
        tail,
        tail_cut,
        tail_cut - carried,
        carried,
        reprefill,
        step_without,
        step_with,
        step_without - step_with,
        step_without / step_with if step_with > 0 else 1.0,
    )
