"""Behaviour check for a refactor: the demo recipe's metrics, bit for bit, at two revisions.

    python benchmarks/same_metrics.py                     # HEAD vs the working tree, 1 process and 2 ranks
    python benchmarks/same_metrics.py --before 5d256ae    # the commit a refactor started from
    python benchmarks/same_metrics.py --after HEAD        # HEAD vs HEAD (the check itself passes)
    python benchmarks/same_metrics.py --nprocs 1 --steps 10

Runs recipes/grpo_tiny.py (the `make demo` recipe) with a fixed seed, for `--steps` steps, once per
side and per process count (1: a plain process; 2: `torchrun --nproc_per_node=2`), and compares
every step's reward, loss and grad-norm columns of metrics.jsonl with exact float equality
(json writes floats with repr, which round-trips, so equal text is equal bits).

A revision runs from a temporary `git worktree add --detach` (removed afterwards) with
PYTHONPATH=<worktree>, so its own hybrid_rl is imported and not the editable install's (checked:
each side prints where `hybrid_rl` came from). The working tree runs with PYTHONPATH=<repo>.
Both sides read ONE recipe YAML (a snapshot of `--yaml`, default the working tree's
recipes/grpo_tiny.yaml, copied beside each side's own recipe script), plus the same explicit
overrides (below), so a change to the YAML's defaults between the revisions is not a difference.
The overrides also switch on what the refactor touches: a reference model with the KL in the
reward, two optimizer steps per GRPO step (old-policy scoring, shuffling), validation and a
checkpoint every `--steps // 2` steps.

Prints a table (per side and process count: steps compared, first / last reward, differing
values), then ONE JSON object as the last line; exits 1 on any difference (or a failed run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join("recipes", "grpo_tiny.py")
# The columns the issue names (reward, loss, grad norm) and the rest of what a step computes from
# the same numbers: equal inputs give equal values, so a difference in any is a change of behaviour.
REQUIRED = ("reward/mean", "actor/loss", "actor/grad_norm")
ALSO = ("reward/", "actor/", "response/", "rollout/", "val/pass@1", "val/reward_mean")


def overrides(steps: int, out_dir: str, model_dir: str) -> list[str]:
    half = max(1, steps // 2)
    return [
        f"trainer.total_steps={steps}",
        "trainer.seed=0",
        "trainer.progress_bar=false",
        "trainer.resume=none",
        f"trainer.out_dir={out_dir}",
        f"model.path={model_dir}",
        "data.batch_size=32",
        "data.num_prompts=1000",
        "data.val_split=0.05",
        "data.val_batch_size=16",
        f"trainer.val_every={half}",
        f"trainer.save_every={half}",
        "rollout.n=8",
        "rollout.max_new_tokens=4",
        "rollout.temperature=1.0",
        "rollout.seed=0",
        "algorithm.mini_batch_size=128",
        "algorithm.kl_placement=reward",
        "algorithm.kl_coef=0.01",
        "algorithm.kl_estimator=k1",
        "algorithm.entropy_coef=0.01",
        "optim.lr=2.5e-3",
        "optim.grad_clip=1.0",
        "trainer.micro_batch_size=128",
        "trainer.log_every=0",
    ]


def free_port() -> int:
    """A port nobody listens on now (torchrun's static rendezvous needs a real one: port 0 hangs)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run_side(tree: str, yaml_text: str, nproc: int, steps: int, work: str) -> list[dict]:
    """metrics.jsonl rows of the recipe as `tree` has it, run in a fresh directory under `work`."""
    os.makedirs(os.path.join(work, "recipes"))
    script = os.path.join(work, RECIPE)
    shutil.copy(os.path.join(tree, RECIPE), script)
    with open(os.path.join(work, "recipes", "grpo_tiny.yaml"), "w") as f:
        f.write(yaml_text)
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import hybrid_rl; print(hybrid_rl.__file__)"],
        env=env,
        cwd=work,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not os.path.realpath(where).startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"PYTHONPATH={tree} imported hybrid_rl from {where}, not from that tree")
    print(f"  {tree}: hybrid_rl from {where}, {nproc} process(es)", file=sys.stderr)
    out_dir = os.path.join(work, "out")
    model_dir = os.path.join(work, "tiny_qwen2")
    # The recipe's own model, built by the tree's code: a recipe refuses a model.path with no model unless told
    # to create it (--create-model), a flag older trees do not know.
    build = (
        "import sys\n"
        "try:\n    from hybrid_rl.data.digits import DIGIT_WORDS\n"
        "except ImportError:  # a tree from before the layout move (issue 35)\n"
        "    from hybrid_rl.rewards.toy import DIGIT_WORDS\n"
        "from hybrid_rl.models.tiny import build_tiny_model_dir as b\n"
        "b(sys.argv[1], DIGIT_WORDS, hidden_size=128, num_layers=2, seed=0)\n"
    )
    subprocess.run([sys.executable, "-c", build, model_dir], env=env, cwd=work, check=True)
    args = overrides(steps, out_dir, model_dir)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = (
        [sys.executable, script]
        if nproc == 1
        else [torchrun, f"--nproc_per_node={nproc}", f"--master_port={free_port()}", script]
    )
    done = subprocess.run(cmd + args, env=env, cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"the recipe failed ({tree}, {nproc} process(es), rc {done.returncode}):\n{done.stderr[-4000:]}"
        )
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(before: list[dict], after: list[dict]) -> tuple[int, list[str]]:
    """(values compared, descriptions of the differences) between two metrics.jsonl histories."""
    b = {r["step"]: r for r in before}
    a = {r["step"]: r for r in after}
    diffs = []
    if sorted(b) != sorted(a):
        diffs.append(f"steps differ: {sorted(b)} vs {sorted(a)}")
    n = 0
    for step in sorted(set(a) & set(b)):
        keys = {k for k in set(a[step]) | set(b[step]) if k in REQUIRED or k.startswith(ALSO)}
        for k in REQUIRED:
            if step > 0 and k not in keys:
                diffs.append(f"step {step}: {k} missing on both sides")
        for k in sorted(keys):
            n += 1
            x, y = b[step].get(k), a[step].get(k)
            # Exact equality: a float's repr round-trips, so equal floats are equal bits.
            if x != y or type(x) is not type(y):
                diffs.append(f"step {step} {k}: {x!r} -> {y!r}")
    return n, diffs


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="HEAD", help="git revision of the reference side (default HEAD)")
    p.add_argument("--after", default="", help="git revision of the other side (default: the working tree)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--nprocs", default="1,2", help="process counts, comma-separated (default 1,2)")
    p.add_argument(
        "--yaml",
        default=os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        help="the recipe YAML both sides read (snapshotted once, at the start)",
    )
    args = p.parse_args(argv)
    with open(args.yaml) as f:
        yaml_text = f.read()
    nprocs = [int(x) for x in args.nprocs.split(",")]
    tmp = tempfile.mkdtemp(prefix="same_metrics_")
    trees, labels, results, failed = {}, {}, [], False
    try:
        for side, rev in (("before", args.before), ("after", args.after)):
            if rev:
                trees[side] = os.path.join(tmp, f"tree_{side}")
                git("worktree", "add", "--detach", trees[side], rev)
            else:
                trees[side] = ROOT
        labels = {
            s: (git("rev-parse", "--short", "HEAD", cwd=t) if t != ROOT else "working tree") for s, t in trees.items()
        }
        for nproc in nprocs:
            histories = {}
            for side in ("before", "after"):
                histories[side] = run_side(
                    trees[side], yaml_text, nproc, args.steps, os.path.join(tmp, f"run_{side}_{nproc}")
                )
            n, diffs = compare(histories["before"], histories["after"])
            last = histories["after"][-1] if histories["after"] else {}
            results.append(
                {
                    "nproc": nproc,
                    "steps": len(histories["after"]),
                    "values_compared": n,
                    "differences": len(diffs),
                    "first_diffs": diffs[:10],
                    "reward_first": histories["after"][0].get("reward/mean") if histories["after"] else None,
                    "reward_last": last.get("reward/mean"),
                }
            )
            failed |= bool(diffs)
    except (RuntimeError, subprocess.CalledProcessError) as err:
        print(f"error: {err}", file=sys.stderr)
        failed = True
    finally:
        for side, tree in trees.items():
            if tree != ROOT:
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"same_metrics: {labels.get('before', args.before)} vs {labels.get('after', args.after or 'working tree')}, "
        f"{args.steps} steps, columns {', '.join(REQUIRED)} (+ {', '.join(ALSO)})"
    )
    print(f"{'procs':>5} {'steps':>5} {'values':>7} {'diffs':>5} {'reward first':>13} {'reward last':>12}")
    for r in results:
        print(
            f"{r['nproc']:>5} {r['steps']:>5} {r['values_compared']:>7} {r['differences']:>5} "
            f"{r['reward_first'] or 0:>13.4f} {r['reward_last'] or 0:>12.4f}"
        )
        for d in r["first_diffs"]:
            print(f"      {d}")
    ok = not failed and len(results) == len(nprocs)
    print(
        json.dumps(
            {
                "ok": ok,
                "before": labels.get("before"),
                "after": labels.get("after"),
                "steps": args.steps,
                "results": results,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
