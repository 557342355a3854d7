"""End to end: the tiny demo with PPO and a critic (recipes/ppo_tiny.yaml, issue 36) must learn the task.

The demo's PPO variant runs as `python recipes/grpo_tiny.py --config recipes/ppo_tiny.yaml`. The first test checks
that the YAML is the GRPO demo's with the overrides below (what the YAML's header and the results file say); the
second runs the recipe with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "recipes")

# recipes/ppo_tiny.yaml as overrides of recipes/grpo_tiny.yaml (its header; benchmarks/results/ppo_cpu_2026-11-28.md).
PPO_OVERRIDES = [
    "algorithm.advantage=gae",
    "algorithm.adv_eps=0.05",
    "algorithm.mini_batch_size=64",
    "critic.lr=2e-3",
    "critic.lr_warmup_steps=48",
    "trainer.micro_batch_size=1024",
]


def _metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_ppo_yaml_is_the_demo_with_the_documented_overrides():
    """recipes/ppo_tiny.yaml equals recipes/grpo_tiny.yaml plus PPO_OVERRIDES, key for key.

    Catches: the YAML and the command the results file and this file's end-to-end test run drifting apart (a
    key changed in one of them only), or the GRPO demo's YAML changing under the PPO variant unnoticed."""
    from hybrid_rl import load_config

    ppo = load_config(os.path.join(RECIPES, "ppo_tiny.yaml"))
    demo = load_config(os.path.join(RECIPES, "grpo_tiny.yaml"), PPO_OVERRIDES + ["trainer.out_dir=runs/ppo_tiny"])
    assert ppo == demo
    assert ppo.algorithm.advantage == "gae" and ppo.has_critic
    assert ppo.data.batch_size * ppo.rollout.n == 1024, "the GRPO demo's batch: 128 prompts x 8 samples"


@pytest.mark.slow
def test_ppo_demo_learns_the_task_and_the_stop(tmp_path):
    """The PPO variant, one process, seed 0, the demo's 40 steps: last-10% reward >= 0.9 (issue 36's target).

    Seeds 0-4 reached 0.994-0.999 in one process (benchmarks/results/ppo_cpu_2026-11-28.md); runs are
    bit-reproducible on one machine with one thread, so a failure means a change moved the sampling streams or
    the numerics of the actor or the critic. 0.9 needs the stop token (the digits alone pay 0.9), so the last
    steps' truncated share must be low too; with the critic at 5e-3 (it collapses to one output for every input)
    the same run stayed at 0.897 with truncated 1.00.
    Catches: a change to PPO's path (token rewards, GAE, the critic's values or update) after which the demo no
    longer learns the digits and the stop in its 40 steps; not planted one by one (tests/unit/algorithms/test_gae.py
    pins the pieces)."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(RECIPES, "grpo_tiny.py"),
        "--config",
        os.path.join(RECIPES, "ppo_tiny.yaml"),
        "--create-model",
        f"model.path={tmp_path / 'model'}",
        f"trainer.out_dir={out}",
        "trainer.resume=none",
        "trainer.progress_bar=false",
        "trainer.log_every=10",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as measured: one thread, the run's numerics
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _metrics(str(out))
    assert len(rows) == 40
    rewards = [r["reward/mean"] for r in rows]
    k = len(rewards) // 10
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    curve = " ".join(f"{r:.2f}" for r in rewards)
    assert first < 0.2, f"a random-init policy should score low, got {first:.3f}"
    assert last >= 0.9, f"last-10% reward {last:.3f} < 0.9 (first 10% {first:.3f}); reward/mean per step: {curve}"
    truncated = sum(r["response/truncated"] for r in rows[-k:]) / k
    assert truncated < 0.5, f"the stop was not learned: truncated {truncated:.2f} over the last {k} steps; {curve}"
