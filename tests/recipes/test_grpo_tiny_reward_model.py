"""End to end: the demo recipe with `reward.model_path=<dir>`, launched as a user launches it; the
reward (the model's score) must rise, and the memory report shows the reward model in its stage only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_recipe_with_a_reward_model_raises_the_models_reward(tmp_path):
    from hybrid_rl.rewards.tiny_model import random_reward_model_dir

    rm_dir = random_reward_model_dir(str(tmp_path / "rm"))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "recipes", "grpo_tiny.py"),
        f"reward.model_path={rm_dir}",
        "--create-model",
        f"model.path={tmp_path / 'model'}",
        f"trainer.out_dir={out}",
        "trainer.total_steps=20",
        "data.batch_size=16",
        "offload.reward_model=true",
        "trainer.progress_bar=false",
        "trainer.log_every=5",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 20
    for m in lines:
        assert m["reward/mean"] == pytest.approx(m["reward/model_mean"]), "the reward is the model's score alone"
        assert "reward/rule_mean" not in m and m["reward/model_std"] > 0
    rewards = [m["reward/mean"] for m in lines]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"the reward model's score did not rise: first {first:.3f} -> last {last:.3f}"
    # The memory report: the reward model is on the device at its REWARD stage and nowhere else.
    table = (out / "memory.txt").read_text().splitlines()
    head = table.index(next(line for line in table if line.startswith("boundary")))
    col = table[head].split().index("reward_model")
    rows = {line.split()[0]: float(line.split()[col]) for line in table[head + 1 :] if line.strip()}
    assert rows["reward:ready"] > 0 and all(v == 0 for k, v in rows.items() if k != "reward:ready"), rows
