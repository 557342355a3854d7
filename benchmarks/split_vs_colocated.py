"""Step time of the two placements on CPU with the same 2 processes: colocated (both ranks generate and
train) against split (1 learner + 1 rollout rank) at max_staleness 0, 1 and 2, on the tiny model.

    python benchmarks/split_vs_colocated.py [--steps 12] [--batch 32] [--tokens 4]

Each configuration is one 2-rank launch (tests/distributed/launch.py) of `Trainer.fit(steps)`; the table
gives the median seconds per step after the first 2 (warm-up), the rollout and train seconds the metrics
report, and for split the staleness and each pool's wait. The load average is printed beside: on a shared
machine the numbers are indicative only. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _fit(rank: int, overrides: list[str], steps: int) -> list[dict]:
    from hybrid_rl.config.load import load_config
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.trainer import Trainer

    D.init("cpu", timeout_s=120)
    tr = Trainer(load_config(None, overrides))
    history = tr.fit(steps)
    tr.close()
    return [{k: v for k, v in m.items() if isinstance(v, (int, float))} for m in history]


def _summary(history: list[dict], warmup: int = 2) -> dict:
    h = history[warmup:] or history

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in h)

    return {
        "step_s": med("time/step"),
        "rollout_s": med("time/rollout"),
        "train_s": med("time/train") + med("time/score"),
        "staleness": med("split/staleness_mean"),
        "learner_wait_s": med("split/learner_wait_s") + med("split/batch_wait_s"),
        "rollout_wait_s": med("split/rollout_wait_s"),
        "reward_last": history[-1].get("reward/mean", 0.0),
    }


def main() -> None:
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir
    from tests.distributed.launch import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="split_bench_")
    model = build_tiny_model_dir(os.path.join(tmp, "model"), DIGIT_WORDS, hidden_size=64, num_layers=2)
    base = [
        f"model.path={model}",
        f"data.batch_size={args.batch}",
        "rollout.n=8",
        f"rollout.max_new_tokens={args.tokens}",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "trainer.log_every=0",
        "optim.lr=2.5e-3",
    ]
    configs = {
        "colocated": [],
        **{f"split k={k}": ["trainer.placement=split", f"trainer.max_staleness={k}"] for k in (0, 1, 2)},
    }
    load_before = os.getloadavg()
    rows = {}
    for name, extra in configs.items():
        out = os.path.join(tmp, name.replace(" ", "_").replace("=", ""))
        histories = run_ranks(_fit, world=2, args=([*base, f"trainer.out_dir={out}", *extra], args.steps), timeout=900)
        rows[name] = _summary(histories[0])
    load_after = os.getloadavg()
    print(
        f"CPU, 2 processes, tiny model, batch {args.batch} x 8, {args.tokens} new tokens, {args.steps} steps "
        f"(median after 2); load average before {load_before[0]:.2f}, after {load_after[0]:.2f}"
    )
    print(
        f"{'placement':<12} {'step s':>8} {'rollout s':>10} {'train s':>8} {'lag':>5} {'learner wait':>13} "
        f"{'rollout wait':>13}"
    )
    for name, r in rows.items():
        print(
            f"{name:<12} {r['step_s']:>8.3f} {r['rollout_s']:>10.3f} {r['train_s']:>8.3f} {r['staleness']:>5.1f} "
            f"{r['learner_wait_s']:>13.3f} {r['rollout_wait_s']:>13.3f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "split_vs_colocated",
                "load_avg": [load_before[0], load_after[0]],
                "args": vars(args),
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
