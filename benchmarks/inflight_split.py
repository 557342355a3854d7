"""In-flight weight updates in the split placement (issue 37, trainer.inflight_update): drain against continue on CPU,
1 learner + 1 rollout rank, the tiny model, at trainer.max_staleness 1 and 2, seeds 0-2.

    python benchmarks/inflight_split.py [--steps 14] [--seeds 0,1,2] [--ks 1,2]

What continue changes is which weights sample a batch's later tokens: under drain a batch is sampled by the one
version it started with (b - k); under continue by every version the learner makes while it decodes. So the
measure is `split/token_staleness_mean` (versions behind the learner, per trained token) against
`split/staleness_mean` (per group: its oldest token, what the admission rule bounds), with the versions taken
mid-batch per step, the step time and the reward of the last 5 steps beside.

Where it can matter: only where generation is the longer half. With 1 learner and 1 rollout rank on a 2-core CPU the
learner is (a CPU decode step is cheap and compute-bound; training costs about 4 forwards a token), so the rollout
rank finishes its batch before the next version exists and nothing lands mid-batch. `--decode-ms X` makes every native
decode step take at least X ms on the rollout rank (a bandwidth-bound GPU step, whose cost hardly depends on its rows;
the same on both sides), which makes generation the longer half. Each configuration is one 2-rank launch
(tests/distributed/launch.py) of `Trainer.fit(steps)`, drain and continue of one seed and k back to back; medians
and means are over the steps after the first 2. The rollout is the longer half here (32 new tokens a sample, the
random-init model rarely stops early), as where split pays. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)  # the rank function of split_vs_colocated.py beside this script
from split_vs_colocated import _fit as fit_ranks  # noqa: E402

MODES = ("drain", "continue")


def _fixed_decode_step(ms: float) -> None:
    """Every native decode step (lean path, the CPU one) takes at least `ms`: a bandwidth-bound GPU decode step, whose
    cost hardly depends on its rows, in place of a CPU step that is cheap and compute-bound (module docstring)."""
    import time

    from hybrid_rl.rollout.native import decode_path

    step = decode_path.LeanDecodeStep.__call__

    def slow(self, *args):
        t0 = time.perf_counter()
        out = step(self, *args)
        time.sleep(max(0.0, ms / 1e3 - (time.perf_counter() - t0)))
        return out

    decode_path.LeanDecodeStep.__call__ = slow


def _fit(rank: int, overrides: list[str], steps: int, decode_ms: float = 0.0) -> list[dict]:
    """split_vs_colocated.py's rank function, each decode step first made to cost at least `decode_ms` (0: as is)."""
    if decode_ms > 0:
        _fixed_decode_step(decode_ms)
    return fit_ranks(rank, overrides, steps)


def summary(history: list[dict], warmup: int = 2) -> dict:
    """One run: means of the staleness measures and versions taken mid-batch, the median step, the last 5 rewards."""
    h = history[warmup:] or history

    def mean(key: str) -> float:
        return statistics.mean(m.get(key, 0.0) for m in h)

    return {
        "token_staleness": mean("split/token_staleness_mean"),
        "group_staleness": mean("split/staleness_mean"),
        "inflight_per_step": mean("split/inflight_updates"),
        "step_s": statistics.median(m["time/step"] for m in h),
        "rollout_s": statistics.median(m["time/rollout"] for m in h),
        "reward_last5": statistics.mean(m["reward/mean"] for m in history[-5:]),
    }


def main(argv=None) -> dict:
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir
    from tests.distributed.launch import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--ks", default="1,2", help="trainer.max_staleness values")
    ap.add_argument("--batch", type=int, default=16, help="data.batch_size (x 4 samples)")
    ap.add_argument("--tokens", type=int, default=32, help="rollout.max_new_tokens")
    ap.add_argument(
        "--decode-ms", type=float, default=0.0, help="each decode step takes at least this long (0: as it comes)"
    )
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="inflight_bench_")
    model = build_tiny_model_dir(os.path.join(tmp, "model"), DIGIT_WORDS, hidden_size=128, num_layers=2)
    base = [
        f"model.path={model}",
        f"data.batch_size={a.batch}",
        "rollout.n=4",
        f"rollout.max_new_tokens={a.tokens}",
        "trainer.placement=split",
        "trainer.rollout_ranks=1",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "trainer.log_every=0",
        "optim.lr=2.5e-3",
        "algorithm.rollout_correction=tis_token",
    ]
    load_before = os.getloadavg()
    runs = []
    for seed in map(int, a.seeds.split(",")):
        for k in map(int, a.ks.split(",")):
            for mode in MODES:
                out = os.path.join(tmp, f"s{seed}_k{k}_{mode}")
                extra = [f"trainer.max_staleness={k}", f"trainer.inflight_update={mode}", f"trainer.seed={seed}"]
                args = ([*base, f"trainer.out_dir={out}", *extra], a.steps, a.decode_ms)
                hist = run_ranks(_fit, world=2, args=args, timeout=900)
                runs.append({"seed": seed, "k": k, "mode": mode, **summary(hist[0])})
    load_after = os.getloadavg()
    print(
        f"CPU, split 1 + 1 ranks, tiny model, {a.batch} x 4 samples, {a.tokens} new tokens, decode step >= "
        f"{a.decode_ms:g} ms, {a.steps} steps (after 2); "
        f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    head = ("seed", "k", "mode", "token lag", "group lag", "mid-batch", "step s", "reward")
    print("{:>4} {:>2} {:<9} {:>9} {:>9} {:>9} {:>7} {:>7}".format(*head))
    for r in runs:
        print(
            f"{r['seed']:>4} {r['k']:>2} {r['mode']:<9} {r['token_staleness']:>9.3f} {r['group_staleness']:>9.3f} "
            f"{r['inflight_per_step']:>9.2f} {r['step_s']:>7.3f} {r['reward_last5']:>7.3f}"
        )
    agg = {}
    for k in sorted({r["k"] for r in runs}):
        for mode in MODES:
            rs = [r for r in runs if r["k"] == k and r["mode"] == mode]
            agg[f"k{k}_{mode}"] = {
                key: statistics.mean(r[key] for r in rs) for key in rs[0] if key not in ("seed", "k", "mode")
            }
    for name, v in agg.items():
        print(
            f"mean {name:<12} token lag {v['token_staleness']:.3f}, group lag {v['group_staleness']:.3f}, "
            f"{v['inflight_per_step']:.2f} versions mid-batch a step, step {v['step_s']:.3f} s"
        )
    result = {
        "benchmark": "inflight_split",
        "load_avg": [load_before[0], load_after[0]],
        "args": vars(a),
        "runs": runs,
        "aggregate": agg,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
