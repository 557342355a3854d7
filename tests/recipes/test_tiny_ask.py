"""End to end: the tiny multi-turn task (envs/tiny_ask.py: ask for a hidden digit, then answer it) is learned
by the Trainer with an environment: episodes through the native engine, observation tokens masked, GRPO over
the G episodes of a row. Catches: anything in the episode path that breaks credit assignment (observation
tokens trained, a turn re-tokenized, rewards paired with the wrong episode or group)."""

from __future__ import annotations

import json
import os

import pytest


def ask_config(tmp_path, steps: int, *extra: str):
    """The learnable setting (tiny_ask's docstring) on rows written as a jsonl file."""
    from hybrid_rl import load_config
    from hybrid_rl.envs.tiny_ask import ask_rows, build_ask_model_dir

    model = build_ask_model_dir(str(tmp_path / "model"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ask_rows(512, seed=0)))
    return load_config(
        None,
        [
            f"model.path={model}",
            "data.task=jsonl",
            f"data.path={rows}",
            "env.name=tiny_ask",
            "rollout.max_turns=2",
            "rollout.max_new_tokens=1",
            "rollout.max_episode_tokens=32",
            "rollout.n=8",
            "data.batch_size=64",
            f"trainer.total_steps={steps}",
            "optim.lr=3e-3",
            "algorithm.kl_coef=0",
            "trainer.micro_batch_size=512",
            f"trainer.out_dir={tmp_path / 'run'}",
            "trainer.progress_bar=false",
            "trainer.resume=none",
            "trainer.log_every=0",
            *extra,
        ],
    )


@pytest.mark.usefixtures("torch_one_thread")
def test_the_tiny_multi_turn_task_learns(tmp_path):
    from hybrid_rl import Trainer

    history = Trainer(ask_config(tmp_path, 80)).fit()
    rewards = [m["reward/mean"] for m in history]
    k = len(rewards) // 10
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    curve = " ".join(f"{r:.2f}" for r in rewards)
    assert first <= 0.3 and last >= 0.8, f"first 10% {first:.3f}, last 10% {last:.3f}; reward/mean per step: {curve}"
    m = history[-1]
    assert m["episode/turns"] > 1.9 and m["episode/end_done"] == 1.0  # ask, then answer
    assert m["episode/observation_tokens"] > 0 and m["episode/reward"] == pytest.approx(m["reward/mean"])
    print(f"tiny_ask: first 10% {first:.3f}, last 10% {last:.3f}: {curve}")
    assert os.path.isfile(tmp_path / "run" / "metrics.jsonl")
