"""The placement half of ``python -m hybrid_rl.plan``: step time of colocated and split at each R and k.

    python -m hybrid_rl.plan --from-run runs/x/metrics.jsonl --run-gpus 2 --gpus 8
    python -m hybrid_rl.plan --from-run runs/w2/metrics.jsonl --from-run runs/w1/metrics.jsonl --run-gpus 2,1 --gpus 2
    python -m hybrid_rl.plan --placement split --gpus 8 --rollout-s 24 --train-s 8 --switch-s 2 --sync-s 0.2

Rates come from runs' metrics.jsonl (--from-run, repeatable; --run-gpus: the ranks of each colocated run,
whose metrics do not record them) or from named assumptions (--rollout-s / --train-s: seconds per step
of each half measured on --run-gpus ranks colocated, --switch-s, --sync-s, and the terms that do not
scale with ranks, --rollout-fixed-s and --train-comm-s), which a flag also overrides on measured runs.
Runs at two rank counts (a 1-process run beside the W-rank one) measure those two terms
(rates.fit_rates); one run assumes linear scaling and the output says so. A split run among them gives the
split placements its pools' own rates (rates.fit_placements).
Prints a table, the recommendation, and a JSON object as the last line.
The memory bill per pool of a split placement is not planned here yet (the colocated planner's table
is the learner's and the engine's bill on one rank).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Sequence

from hybrid_rl.plan.rates import (
    Prediction,
    Rates,
    fit_placements,
    predict_all,
    rates_from_records,
    read_metrics,
    recommend,
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
)


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
    return p


def _counts(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rank counts separated by commas, got {s!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"rank counts must be >= 1, got {s!r}")
    return out


def _rates(args, parser) -> tuple[Rates, dict]:
    """Measured rates (if --from-run), each named assumption overriding its measured value."""
    worlds = args.run_gpus or (args.gpus,) * max(1, len(args.from_run))
    if args.from_run and len(worlds) != len(args.from_run):
        parser.error(
            f"--run-gpus gives {len(worlds)} rank counts for {len(args.from_run)} --from-run files: "
            "give one per run, in the same order"
        )
    if args.from_run:
        runs = [rates_from_records(read_metrics(path), world=w) for path, w in zip(args.from_run, worlds)]
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
    return rates, meta


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
    try:
        rates, meta = _rates(args, parser)
        preds = predict_all(rates, args.gpus, args.max_staleness, args.tp, placements, meta["split_rates"])
        best = recommend(preds)
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
    print(format_table(preds, best))
    print(f"recommended: {best.label} ({best.step_s:.3f} s per step)")
    sr = meta["split_rates"]
    run = {**meta, "split_rates": None if sr is None else dataclasses.asdict(sr)}
    print(
        json.dumps(
            {
                "rates": dataclasses.asdict(rates),
                "run": run,
                "recommended": best.label,
                "predictions": [{**dataclasses.asdict(p), "label": p.label} for p in preds],
            },
            sort_keys=True,
        )
    )
    return 0
