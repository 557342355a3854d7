"""Colocated against split placement (max_staleness 0, 1, 2) on the same 2 CPU processes, with the planner's
prediction beside each measurement (issue 27).

    python benchmarks/placement.py [--steps 60] [--settings tiny,long] [--long-tokens 64,128]

Settings:
  tiny  the tiny recipe (recipes/grpo_tiny.yaml: 128 prompts x 8 samples, 4 new tokens): training is the
        longer half.
  long  long, uneven completions: 2 prompts x 4 samples, EOS banned for the first 64 tokens
        (rollout.min_new_tokens), at most 128, no KL or entropy term: each decode step costs about the same
        for 8 rows as for 4, the whole batch waits for its longest row, and training is one parallel pass,
        so generation is the longer half.
Each configuration is one launch (tests/distributed/launch.py) of `Trainer.fit(steps)`: colocated on 2 ranks
(both generate and train), colocated on 1 process (the planner's second input), and split (rank 0 learns,
rank 1 generates). Per configuration: the median seconds per step after the first 2 (warm-up), tokens
generated per second, each pool's idle fraction (split: the learner's wait for batches and the rollout rank's
wait for weights, over the step; colocated has one pool, which never waits on another), the mean staleness
of trained samples, and the mean reward of the last 10 steps finished by a fixed wall time (the shortest
run's total time in that setting: every run reaches it).
The prediction: hybrid_rl/plan/rates.py's model fitted to the two colocated runs (2 ranks and 1 process),
as `python -m hybrid_rl.plan --from-run <2-rank metrics.jsonl> --from-run <1-process metrics.jsonl>
--run-gpus 2,1 --gpus 2` does; no split run is an input, so every split row is a prediction. A second
prediction adds the split k=0 run as an input (`fit_placements`: the split rows then use its pools' own
rates): split k=1 and k=2 stay out of sample, k=0 is marked as the input it is.
The load average is printed before and after: on a shared machine the numbers are indicative only.
The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTINGS = {
    "tiny": ["data.batch_size=128", "rollout.n=8", "rollout.max_new_tokens=4"],
    "long": [
        "data.batch_size=2",
        "rollout.n=4",
        "rollout.max_new_tokens=LONG_MAX",
        "rollout.min_new_tokens=LONG_MIN",
        "trainer.micro_batch_size=8",
        "algorithm.mini_batch_size=8",
        "algorithm.kl_coef=0",
        "algorithm.entropy_coef=0",
    ],
}
# name: (ranks, overrides). The two colocated runs are the planner's inputs (rank counts 2 and 1).
CONFIGS = {
    "colocated": (2, []),
    "colocated 1 proc": (1, []),
    **{f"split k={k}": (2, ["trainer.placement=split", f"trainer.max_staleness={k}"]) for k in (0, 1, 2)},
}
PREDICTED = {"colocated": "colocated", **{f"split k={k}": f"split R=1 k={k}" for k in (0, 1, 2)}}


def _fit(rank: int, overrides: list[str], steps: int) -> list[dict]:
    from hybrid_rl.config.load import load_config
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.trainer import Trainer

    D.init("cpu", timeout_s=300)
    tr = Trainer(load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides))
    history = tr.fit(steps)
    tr.close()
    return [{k: v for k, v in m.items() if isinstance(v, (int, float))} for m in history]


def _reward_at(history: list[dict], wall_s: float, window: int = 10) -> float:
    """Mean reward of the last `window` steps finished by `wall_s` seconds of steps."""
    done, t = [], 0.0
    for m in history:
        t += m["time/step"]
        if t > wall_s:
            break
        done.append(m["reward/mean"])
    return sum(done[-window:]) / max(1, len(done[-window:]))


def _summary(history: list[dict], n_seqs: int, warmup: int = 2) -> dict:
    h = history[warmup:] or history

    def med(fn) -> float:
        return statistics.median(fn(m) for m in h)

    step = med(lambda m: m["time/step"])
    learner_wait = med(lambda m: m.get("split/learner_wait_s", 0.0) + m.get("split/batch_wait_s", 0.0))
    return {
        "step_s": step,
        "rollout_s": med(lambda m: m.get("time/rollout", 0.0) + m.get("time/reward", 0.0)),
        "train_s": med(lambda m: sum(m.get(k, 0.0) for k in ("time/score", "time/advantage", "time/train"))),
        "tokens_per_s": med(lambda m: m["response/length"] * n_seqs / m["time/step"]),
        "learner_idle": learner_wait / step,
        "rollout_idle": med(lambda m: m.get("split/rollout_wait_s", 0.0)) / step,
        "staleness": med(lambda m: m.get("split/staleness_mean", 0.0)),
        "response_length": med(lambda m: m["response/length"]),
        "total_s": sum(m["time/step"] for m in history),
    }


def _predict(runs: list[tuple[int, list[dict]]]) -> dict:
    """The planner's step time per configuration from runs given as (ranks, history): the two colocated runs
    (2 ranks and 1 process), as `python -m hybrid_rl.plan --from-run <2-rank> --from-run <1-proc> --run-gpus
    2,1 --gpus 2` does, and with a split run among them its pools' own rates for the split rows."""
    from hybrid_rl.plan.rates import fit_placements, predict_all, rates_from_records, recommend

    rates, split_rates = fit_placements([rates_from_records(h, world=w, skip=2) for w, h in runs])
    preds = predict_all(rates, 2, (0, 1, 2), split_rates=split_rates)
    return {
        "by_label": {p.label: p.step_s for p in preds},
        "recommended": recommend(preds).label,
        "rates": vars(rates),
        "split_rates": None if split_rates is None else vars(split_rates),
    }


def run_setting(name: str, model: str, tmp: str, steps: int, long_tokens: tuple[int, int]) -> dict:
    from tests.distributed.launch import run_ranks

    extra = [
        x.replace("LONG_MAX", str(long_tokens[1])).replace("LONG_MIN", str(long_tokens[0])) for x in SETTINGS[name]
    ]
    n_seqs = int(extra[0].split("=")[1]) * int(extra[1].split("=")[1])
    base = [
        f"model.path={model}",
        *extra,
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "trainer.log_every=0",
        f"trainer.total_steps={steps}",
        "trainer.resume=none",
    ]
    histories = {}
    for cfg_name, (world, more) in CONFIGS.items():
        out = os.path.join(tmp, name, cfg_name.replace(" ", "_").replace("=", ""))
        histories[cfg_name] = run_ranks(
            _fit, world=world, args=([*base, f"trainer.out_dir={out}", *more], steps), timeout=1200
        )[0]
    wall = min(sum(m["time/step"] for m in h) for h in histories.values())
    colocated_runs = [(2, histories["colocated"]), (1, histories["colocated 1 proc"])]
    plan = _predict(colocated_runs)
    # The second prediction adds the split k=0 run (its pools' rates): k=1 and k=2 stay out of sample.
    plan_k0 = _predict([*colocated_runs, (2, histories["split k=0"])])
    rows = {}
    for cfg_name, h in histories.items():
        row = _summary(h, n_seqs)
        row["reward_at_wall"] = _reward_at(h, wall)
        label = PREDICTED.get(cfg_name)
        for key, p in (("", plan), ("_with_k0", plan_k0)):
            row[f"predicted_step_s{key}"] = p["by_label"][label] if label else None
            row[f"prediction_error{key}"] = p["by_label"][label] / row["step_s"] - 1.0 if label else None
        rows[cfg_name] = row
    return {
        "rows": rows,
        "wall_s": wall,
        "recommended": plan["recommended"],
        "rates": plan["rates"],
        "recommended_with_k0": plan_k0["recommended"],
        "split_rates_with_k0": plan_k0["split_rates"],
        "overrides": extra,
    }


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _pred_cells(r: dict, key: str, in_sample: bool) -> str:
    if r[f"predicted_step_s{key}"] is None:
        return f"{'input':>8}{'':>7}"
    err = f"{'input':>7}" if in_sample else f"{r[f'prediction_error{key}']:>+7.0%}"
    return f"{r[f'predicted_step_s{key}']:>8.3f}{err}"


def print_table(name: str, res: dict) -> None:
    print(
        f"\n[{name}] {' '.join(res['overrides'])}; reward at a fixed wall time of {res['wall_s']:.1f} s; "
        f"planner recommends: {res['recommended']} ({res['recommended_with_k0']} with the split k=0 run)"
    )
    r = res["rates"]
    print(
        f"planner rates (fit of the two colocated runs): rollout {r['rollout_rank_s']:.3f} rank-s + "
        f"{r['rollout_fixed_s']:.3f} s fixed, train {r['train_rank_s']:.3f} rank-s + {r['train_comm_s']:.3f} s "
        f"collectives, switch {r['switch_s']:.3f} s, sync {r['sync_s']:.3f} s"
    )
    print("pred s / err: from the two colocated runs; +k0 / err: the split k=0 run added (its pools' rates)")
    head = (
        f"{'placement':<17}{'step s':>8}{'pred s':>8}{'err':>7}{'+k0 s':>8}{'err':>7}{'rollout s':>10}"
        f"{'train s':>9}{'tok/s':>8}{'learn idle':>11}{'roll idle':>10}{'lag':>5}{'reward@T':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for cfg_name, r in res["rows"].items():
        print(
            f"{cfg_name:<17}{r['step_s']:>8.3f}{_pred_cells(r, '', False)}"
            f"{_pred_cells(r, '_with_k0', cfg_name == 'split k=0')}"
            f"{r['rollout_s']:>10.3f}{r['train_s']:>9.3f}{r['tokens_per_s']:>8.0f}{r['learner_idle']:>11.0%}"
            f"{r['rollout_idle']:>10.0%}{r['staleness']:>5.1f}{r['reward_at_wall']:>9.3f}"
        )


def main() -> None:
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--settings", default="tiny,long")
    ap.add_argument("--long-tokens", default="64,128", help="min,max new tokens of the long setting")
    args = ap.parse_args()
    long_tokens = tuple(int(x) for x in args.long_tokens.split(","))
    tmp = tempfile.mkdtemp(prefix="placement_bench_")
    # The recipe's model (hidden 128, 2 layers, seed 0).
    model = build_tiny_model_dir(os.path.join(tmp, "model"), DIGIT_WORDS, hidden_size=128, num_layers=2, seed=0)
    before = _uptime()
    results = {name: run_setting(name, model, tmp, args.steps, long_tokens) for name in args.settings.split(",")}
    after = _uptime()
    print(
        "CPU, 2 processes (1 learner + 1 rollout rank for split; the planner's second input on 1), native engine, "
        f"{args.steps} steps per run "
        f"(medians after 2 warm-up steps)\nuptime before: {before}\nuptime after:  {after}"
    )
    for name, res in results.items():
        print_table(name, res)
    print(json.dumps({"benchmark": "placement", "uptime": [before, after], "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
