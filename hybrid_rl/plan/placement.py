"""The placement half of ``python -m hybrid_rl.plan``: step time of colocated and split at each R and k.

    python -m hybrid_rl.plan --from-run runs/x/metrics.jsonl --run-gpus 2 --gpus 8
    python -m hybrid_rl.plan --from-run runs/w2/metrics.jsonl --from-run runs/w1/metrics.jsonl --run-gpus 2,1 --gpus 2
    python -m hybrid_rl.plan --placement split --gpus 8 --rollout-s 24 --train-s 8 --switch-s 2 --sync-s 0.2
    python -m hybrid_rl.plan --from-run runs/x/metrics.jsonl --run-gpus 2 --gpus 8 --partial --decode latency

Rates come from runs' metrics.jsonl (--from-run, repeatable; --run-gpus: the ranks of each colocated run,
whose metrics do not record them) or from named assumptions (--rollout-s / --train-s: seconds per step
of each half measured on --run-gpus ranks colocated, --switch-s, --sync-s, and the terms that do not
scale with ranks, --rollout-fixed-s and --train-comm-s), which a flag also overrides on measured runs.
Runs at two rank counts (a 1-process run beside the W-rank one) measure those two terms
(rates.fit_rates); one run assumes linear scaling and the output says so. A split run among them gives the
split placements its pools' own rates (rates.fit_placements).
--partial adds the colocated step with partial rollouts (rollout.partial; rates.predict_partial's model): the
rollout's tail from the runs' time/rollout_tail or from --rollout-tail-s / --tail-frac, the groups in flight from
--partial-over, and how decode cost grows with rows from --decode. From a run that had rollout.partial on it predicts
the step without, given --tail-frac. --prefill-cost scales what re-prefilling the carried prefixes costs.
Prints a table, the recommendation, and a JSON object as the last line.
The memory bill per pool of a split placement is not planned here yet (the colocated planner's table
is the learner's and the engine's bill on one rank).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from typing import Optional, Sequence

from hybrid_rl.plan.rates import (
    DECODE_MODES,
    PARTIAL_KEY,
    PartialPrediction,
    Prediction,
    Rates,
    decode_latency_share,
    fit_placements,
    predict_all,
    predict_partial,
    ran_partial,
    rates_from_records,
    read_metrics,
    recommend,
    tail_share_from_records,
)

RATE_FLAGS = (
    "--from-run",
    "--placement",
    "--rollout-s",
    "--train-s",
    "--switch-s",
    "--sync-s",
    "--rollout-fixed-s",
    "--train-comm-s",
    "--partial",
    "--rollout-tail-s",
    "--tail-frac",
    "--partial-over",
    "--decode",
    "--prefill-cost",
)
PARTIAL_ONLY = ("rollout_tail_s", "tail_frac", "partial_over", "decode", "prefill_cost")  # read with --partial only


def wants_rates(argv: Sequence[str]) -> bool:
    """Whether a plan command line asks for the placement model rather than the memory bill."""
    return any(a.split("=")[0] in RATE_FLAGS for a in argv)


def _ks(s: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers >= 0 separated by commas, got {s!r}") from None
    if not ks or min(ks) < 0:
        raise argparse.ArgumentTypeError(f"max staleness values must be >= 0, got {s!r}")
    return ks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hybrid_rl.plan",
        description="Predicted step time of the colocated and split placements (rate model).",
    )
    p.add_argument("--gpus", type=int, required=True, help="ranks to place (the world size of the planned run)")
    p.add_argument("--placement", choices=["colocated", "split", "both"], default="both")
    p.add_argument(
        "--from-run",
        action="append",
        default=[],
        help="a run's metrics.jsonl: its measured rates (repeat for runs at other rank counts)",
    )
    p.add_argument(
        "--run-gpus",
        type=_counts,
        help="ranks of each colocated run, comma-separated in --from-run order (default --gpus)",
    )
    p.add_argument("--max-staleness", type=_ks, default=(0, 1, 2), help="k values for split (default 0,1,2)")
    p.add_argument("--tp", type=int, default=1, help="rollout tensor-parallel size: R is a multiple of it")
    for flag, what in (("--rollout-s", "generation + rule rewards"), ("--train-s", "scoring + advantages + update")):
        p.add_argument(flag, type=float, help=f"seconds per step of {what} with --run-gpus ranks colocated")
    p.add_argument("--switch-s", type=float, help="seconds per step of the colocated phase switch")
    p.add_argument("--sync-s", type=float, help="seconds of one split weight sync")
    p.add_argument(
        "--rollout-fixed-s",
        type=float,
        help="seconds per step of generation that fewer rows per rank do not save (decode latency per token)",
    )
    p.add_argument(
        "--train-comm-s", type=float, help="seconds per step a learner group of > 1 rank pays in collectives"
    )
    p.add_argument(
        "--partial",
        action="store_true",
        help="also predict the colocated step with partial rollouts (rollout.partial): the tail cut, the carried "
        "work paid in the next step",
    )
    p.add_argument(
        "--rollout-tail-s",
        type=float,
        help="seconds of the rollout's tail (fewer than half of the rows decoding) with --run-gpus ranks colocated, "
        "without partial rollouts (default: the runs' time/rollout_tail)",
    )
    p.add_argument(
        "--tail-frac", type=float, help="the tail's share of the rollout half without partial rollouts, in [0, 1)"
    )
    p.add_argument(
        "--partial-over", type=float, help="rollout.partial_over: groups in flight per batch group (default 1.5)"
    )
    p.add_argument(
        "--decode",
        choices=DECODE_MODES,
        help="latency: a decode step costs the same whatever its rows; throughput: in proportion to its rows; fit "
        "(default): the fixed generation term's share (0 when one rank count was measured)",
    )
    p.add_argument(
        "--prefill-cost",
        type=float,
        help="a re-prefilled token's cost as a share of a decoded token's per-token cost, in [0, 1] (default 1, an "
        "upper bound; 0: nothing is re-prefilled, rollout.partial_kv=keep or a prefix cache that holds every carried "
        "prefix)",
    )
    return p


def _counts(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rank counts separated by commas, got {s!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"rank counts must be >= 1, got {s!r}")
    return out


def _rates(args, parser) -> tuple[Rates, dict, list[list[dict]]]:
    """Measured rates (if --from-run), each named assumption overriding its measured value; the runs' records."""
    worlds = args.run_gpus or (args.gpus,) * max(1, len(args.from_run))
    if args.from_run and len(worlds) != len(args.from_run):
        parser.error(
            f"--run-gpus gives {len(worlds)} rank counts for {len(args.from_run)} --from-run files: "
            "give one per run, in the same order"
        )
    records = [read_metrics(path) for path in args.from_run]
    if args.from_run:
        runs = [rates_from_records(recs, world=w) for recs, w in zip(records, worlds)]
        rates, split_rates = fit_placements(runs)
        meta = {"runs": [m for _, m in runs], "split_rates": split_rates}
    elif args.rollout_s is None or args.train_s is None:
        parser.error("give --from-run <metrics.jsonl>, or --rollout-s and --train-s (seconds per step)")
    else:
        rates, meta = Rates(0.0, 0.0, 0.0, 0.0), {"runs": [], "split_rates": None}
    over = {
        k: v
        for k, v in {
            "switch_s": args.switch_s,
            "sync_s": args.sync_s,
            "rollout_fixed_s": args.rollout_fixed_s,
            "train_comm_s": args.train_comm_s,
        }.items()
        if v is not None
    }
    rates = dataclasses.replace(rates, **over)
    if meta["split_rates"] is not None:
        meta["split_rates"] = dataclasses.replace(meta["split_rates"], **over)
    # --rollout-s / --train-s are a half's seconds on run_w ranks colocated: the part that scales with ranks
    # is what is left after the fixed / collective term (which a group of one rank does not pay).
    run_w = worlds[0]
    comm = rates.train_comm_s if run_w > 1 else 0.0
    for flag, value, fixed, name in (
        ("--rollout-s", args.rollout_s, rates.rollout_fixed_s, "rollout_rank_s"),
        ("--train-s", args.train_s, comm, "train_rank_s"),
    ):
        if value is not None:
            if value < fixed:
                parser.error(f"{flag} {value} is less than its fixed term {fixed}: the half cannot be shorter")
            rates = dataclasses.replace(rates, **{name: (value - fixed) * run_w})
    return rates, meta, records


def _partial_sides(args, meta: dict, records: list[list[dict]]) -> dict[str, Optional[bool]]:
    """Each colocated --from-run path -> whether that run had rollout.partial on (None: its steps mix both)."""
    out: dict[str, Optional[bool]] = {}
    for path, m, recs in zip(args.from_run, meta["runs"], records):
        if m["rollout_ranks"] == 0:
            try:
                out[path] = ran_partial(recs)
            except ValueError:
                out[path] = None
    return out


def _tail_share(args, rates: Rates, sides: dict[str, Optional[bool]], records: list[list[dict]]) -> tuple[float, str]:
    """(tau, where it came from): --tail-frac, --rollout-tail-s over the rollout half on --run-gpus ranks, or the
    colocated runs' time/rollout_tail (the median of each run's)."""
    cut_run = any(sides.values())
    if args.tail_frac is not None and args.rollout_tail_s is not None:
        raise ValueError("give one of --tail-frac and --rollout-tail-s, not both")
    if args.tail_frac is not None:
        if not 0 <= args.tail_frac < 1:
            raise ValueError(f"--tail-frac {args.tail_frac} must be in [0, 1): the tail's share of the rollout half")
        return args.tail_frac, "--tail-frac"
    if args.rollout_tail_s is not None:
        if cut_run:
            raise ValueError(
                "--rollout-tail-s: the run had rollout.partial on, so its rollout was cut and has no tail to compare "
                "the seconds with: give --tail-frac, the tail's share of a rollout without partial rollouts"
            )
        half = rates.rollout((args.run_gpus or (args.gpus,))[0])
        if not 0 <= args.rollout_tail_s < half:
            raise ValueError(
                f"--rollout-tail-s {args.rollout_tail_s} must be >= 0 and shorter than the rollout half it is part of "
                f"({half:.3f} s with --run-gpus ranks: --rollout-s, or the run's time/rollout + time/reward)"
            )
        return args.rollout_tail_s / half, "--rollout-tail-s"
    if cut_run:
        raise ValueError(
            "--partial: the run had rollout.partial on, so its rollout stopped early and its time/rollout_tail is not "
            "the tail of a rollout without partial rollouts: give --tail-frac (that tail's share of the rollout half) "
            "to predict the step without"
        )
    if not sides:
        raise ValueError("--partial needs the rollout's tail: give --rollout-tail-s or --tail-frac")
    shares = []
    for path, recs in zip(args.from_run, records):
        if path in sides:
            try:
                shares.append(tail_share_from_records(recs))
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from None
    return statistics.median(shares), "the runs' time/rollout_tail"


def _predict_partial(
    args, rates: Rates, preds, sides: dict[str, Optional[bool]], records
) -> tuple[PartialPrediction, str]:
    """--partial: the colocated step with and without partial rollouts, and where the tail share came from."""
    if args.from_run and not sides:
        raise ValueError("--partial predicts the colocated step: give a colocated run's metrics among --from-run")
    mixed = [path for path, on in sides.items() if on is None]
    if mixed:
        raise ValueError(
            f"--partial: {mixed[0]}: its steps mix rollout.partial on and off ({PARTIAL_KEY} in some records only): "
            "give a run's steps of one setting"
        )
    if len(set(sides.values())) > 1:
        raise ValueError("--partial: the --from-run runs mix rollout.partial on and off: give runs of one setting")
    tau, source = _tail_share(args, rates, sides, records)
    decode = args.decode or "fit"
    colocated = next(p for p in preds if p.placement == "colocated")
    part = predict_partial(
        colocated,
        tau,
        1.5 if args.partial_over is None else args.partial_over,
        decode_latency_share(rates, args.gpus, decode),
        "with" if any(sides.values()) else "without",
        decode,
        1.0 if args.prefill_cost is None else args.prefill_cost,
    )
    return part, source


_DECODE_WORDS = {
    "latency": "--decode latency: a decode step costs the same whatever its rows, so carried tokens and their "
    "re-prefill cost nothing: the optimistic bound",
    "throughput": "--decode throughput: a decode step costs in proportion to its rows, so a cut tail saves nothing",
    "fit": "the fixed generation term's share of the rollout half (--decode fit)",
}


def format_partial(part: PartialPrediction, world: int, source: str) -> str:
    """The --partial report: both steps, what the tail costs, what carrying saves and pays, the assumptions."""
    side = (
        "measured with rollout.partial on: the step without is predicted"
        if part.measured == "with"
        else "measured without partial rollouts"
    )
    decode = _DECODE_WORDS[part.decode]
    if part.decode == "fit" and part.latency_share == 0:
        decode = (
            "no fixed generation term was measured (one rank count, no --rollout-fixed-s): taken as throughput-bound, "
            "so partial rollouts only add re-prefill here; --decode latency gives the other bound"
        )
    into = 1.0 - part.tail_cut_share
    return "\n".join(
        [
            f"partial rollouts (colocated, {world} ranks; rates {side}):",
            f"  tail {part.tail_share:.1%} of the rollout half (from {source}); decode {part.latency_share:.0%} "
            f"latency-bound ({decode}); {part.over:g} x the batch's groups in flight (--partial-over)",
            f"  without --partial: rollout {part.rollout_without_s:.3f} s, step {part.step_without_s:.3f} s",
            f"  with --partial:    rollout {part.rollout_with_s:.3f} s, step {part.step_with_s:.3f} s "
            f"({part.speedup:.2f}x)",
            f"  the tail costs {part.tail_s:.3f} s per step; {part.tail_cut_s:.3f} s of it is cut "
            f"({part.tail_cut_share:.0%}: the batch's groups are done {into:.0%} of the way into the tail)",
            f"  carrying saves {part.saved_s:.3f} s (the cut tail's decode latency) and pays "
            f"{part.carried_decode_s:.3f} s decoding the cut tokens + {part.reprefill_s:.3f} s re-prefilling the "
            f"carried prefixes (--prefill-cost {part.prefill_cost:g}) in the next step's body: net "
            f"{part.net_saving_s:+.3f} s per step",
            "  assumptions: rows fall linearly (all to half over the body, half to none over the tail) and a group's "
            "samples end together; carried samples' head start and the prompts' re-prefill are left "
            f"out; rollout.partial_stop = 1; the tail's share is the same on {world} ranks (hybrid_rl/plan/rates.py)",
        ]
    )


def format_table(preds: Sequence[Prediction], best: Prediction) -> str:
    head = f"{'placement':<18}{'rollout s':>10}{'train s':>10}{'switch/sync':>12}{'step s':>9}{'idle':>7}  bound"
    lines = [head, "-" * len(head)]
    for p in preds:
        mark = "  <- recommended" if p is best else ""
        lines.append(
            f"{p.label:<18}{p.rollout_s:>10.3f}{p.train_s:>10.3f}{p.overhead_s:>12.3f}{p.step_s:>9.3f}"
            f"{p.idle_fraction:>7.0%}  {p.bottleneck}{mark}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    placements = ("colocated", "split") if args.placement == "both" else (args.placement,)
    stray = [f for f in PARTIAL_ONLY if getattr(args, f) is not None]
    if stray and not args.partial:
        parser.error(f"--{stray[0].replace('_', '-')} is read with --partial only: add --partial")
    if args.partial and args.placement == "split":
        parser.error(
            "--partial: partial rollouts run in the colocated placement only (rollout.partial refuses "
            "trainer.placement=split): use --placement colocated or both"
        )
    part = None
    try:
        rates, meta, records = _rates(args, parser)
        preds = predict_all(rates, args.gpus, args.max_staleness, args.tp, placements, meta["split_rates"])
        best = recommend(preds)
        sides = _partial_sides(args, meta, records)
        if args.partial:
            part, tail_source = _predict_partial(args, rates, preds, sides, records)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    src = (
        "; ".join(
            f"run {path} ({m['steps']} steps, {m['world']} ranks, R={m['rollout_ranks']})"
            for path, m in zip(args.from_run, meta["runs"])
        )
        or "named assumptions"
    )
    print(
        f"rates from {src}: rollout {rates.rollout_rank_s:.3f} rank-s + {rates.rollout_fixed_s:.3f} s fixed, "
        f"train {rates.train_rank_s:.3f} rank-s + {rates.train_comm_s:.3f} s collectives (> 1 rank), switch "
        f"{rates.switch_s:.3f} s, sync {rates.sync_s:.3f} s per step; {args.gpus} ranks planned"
    )
    if meta["split_rates"] is not None:
        sr = meta["split_rates"]
        print(
            f"split placements from the split runs' pools: rollout {sr.rollout_rank_s:.3f} rank-s + "
            f"{sr.rollout_fixed_s:.3f} s fixed, train {sr.train_rank_s:.3f} rank-s + {sr.train_comm_s:.3f} s "
            f"collectives, sync {sr.sync_s:.3f} s"
        )
    if len({(m["world"], m["rollout_ranks"]) for m in meta["runs"]}) == 1:
        print(
            "one rank count measured: linear data-parallel scaling assumed (no fixed or collective term); add a "
            "run at another rank count (a 1-process run) to measure them"
        )
    if not args.partial:
        for path, on in sides.items():
            if on is None:
                print(f"note: {path}: its steps mix rollout.partial on and off; its rates are a mixture of both")
            elif on:
                print(
                    f"note: {path} had rollout.partial on: its colocated rates are the step with partial rollouts; "
                    "add --partial --tail-frac F to predict the step without"
                )
    print(format_table(preds, best))
    print(f"recommended: {best.label} ({best.step_s:.3f} s per step)")
    if part is not None:
        print(format_partial(part, args.gpus, tail_source))
        print(f"colocated with partial rollouts: {part.step_with_s:.3f} s per step (recommended without: {best.label})")
    sr = meta["split_rates"]
    run = {**meta, "split_rates": None if sr is None else dataclasses.asdict(sr)}
    print(
        json.dumps(
            {
                "rates": dataclasses.asdict(rates),
                "run": run,
                "recommended": best.label,
                "predictions": [{**dataclasses.asdict(p), "label": p.label} for p in preds],
                "partial": None if part is None else dataclasses.asdict(part),
            },
            sort_keys=True,
        )
    )
    return 0
