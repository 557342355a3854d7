"""End to end: the real recipe, launched the way users launch it, must improve the reward."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rewards(out_dir: str) -> list[float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["reward/mean"] for line in f]


@pytest.mark.slow
def test_recipe_two_ranks_learns_the_task(tmp_path):
    """`make demo` as shipped (the YAML's defaults, seed 0, 2 ranks) reaches the README's reward.

    The defaults reached a last-10% reward >= 0.9 for seeds 0-4 on every engine
    (benchmarks/results/grpo_tiny_seeds_cpu_2026-11-25.md); runs are bit-reproducible on one
    machine, so a failure here means a change moved the sampling streams or the numerics.
    """
    out = tmp_path / "run"
    from hybrid_rl import load_config
    from hybrid_rl.runtime.distributed import free_port

    steps = load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), []).trainer.total_steps
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(ROOT, "recipes", "grpo_tiny.py"),
        "--create-model",
        f"model.path={tmp_path / 'model'}",
        f"trainer.out_dir={out}",
        "trainer.resume=none",
        "trainer.progress_bar=false",
        "trainer.log_every=10",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rewards = _rewards(str(out))
    assert len(rewards) == steps
    k = max(1, steps // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert first < 0.2, f"a random-init policy should score low, got {first:.3f}"
    curve = " ".join(f"{r:.2f}" for r in rewards)
    assert last >= 0.9, f"last-10% reward {last:.3f} < 0.9 (first 10% {first:.3f}); reward/mean per step: {curve}"
    assert os.path.isfile(out / "reward_curve.png") and os.path.isfile(out / "config.yaml")
    # The trained policy is saved as a normal HF directory that the ordinary loader reads back.
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer

    saved = str(out / "final_model")
    assert load_tokenizer(saved).eos_token_id is not None
    trained = dict(load_causal_lm(saved).named_parameters())
    initial = dict(load_causal_lm(str(tmp_path / "model")).named_parameters())
    assert max((trained[n] - initial[n]).abs().max().item() for n in initial) > 1e-3


def test_trainer_in_one_process(tmp_path, tiny_model_dir):
    from hybrid_rl import Trainer, load_config

    cfg = load_config(
        os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        [
            f"model.path={tiny_model_dir}",
            f"trainer.out_dir={tmp_path}",
            "trainer.total_steps=3",
            "trainer.progress_bar=false",
            "data.batch_size=8",
            "rollout.n=4",
            "trainer.micro_batch_size=16",
            "algorithm.mini_batch_size=16",
            "algorithm.kl_coef=0.01",
        ],
    )
    trainer = Trainer(cfg)
    history = trainer.fit()
    assert [h["step"] for h in history] == [1, 2, 3]
    from hybrid_rl.models.loading import load_causal_lm

    saved = dict(load_causal_lm(trainer.save_pretrained(str(tmp_path / "saved"))).named_parameters())
    for name, p in trainer.policy.named_parameters():
        assert torch.equal(saved[name], p.detach()), name
    with open(tmp_path / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 3
    for key in [
        "reward/mean",
        "reward/std",
        "reward/accuracy",
        "response/length",
        "actor/kl_ref",
        "actor/entropy",
        "actor/clip_frac",
        "actor/grad_norm",
        "time/rollout",
        "time/score",
        "time/train",
        "time/switch",
    ]:
        assert key in lines[-1], key
    # Two mini-batches per step: the second one is off-policy, so the ratio moves away from 1.
    assert lines[-1]["actor/ratio_max"] > lines[-1]["actor/ratio_min"]
    assert lines[-1]["actor/ratio_max"] > 1.0 or lines[-1]["actor/ratio_min"] < 1.0
    assert lines[-1]["rollout/logp_mismatch"] < 1e-5, "engine and trainer logprobs must agree in fp32"
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    assert (tmp_path / "config.yaml").read_text().count("total_steps: 3") == 1


@pytest.mark.slow
def test_recipe_split_placement_learns_with_staleness_one(tmp_path):
    """`trainer.placement=split` with max_staleness=1 on 2 ranks (1 learner + 1 rollout rank) learns the task,
    last-10% reward >= 0.8 (issue 27). The recipe's 40 steps reached only 0.803 (seed 0): one learner rank takes
    the whole batch and every sample is one version old, so split runs 60 steps (the cosine schedule stretched
    with them): last-10% 0.969 (seed 0) and 0.998 (seed 1). The schedule fixes every batch's weights version,
    so the run is reproducible on one machine.
    Catches: a split loop that trains on the wrong groups, or syncs no weights (the reward would stay flat)."""
    out = tmp_path / "run"
    from hybrid_rl.runtime.distributed import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(ROOT, "recipes", "grpo_tiny.py"),
        "--create-model",
        f"model.path={tmp_path / 'model'}",
        f"trainer.out_dir={out}",
        "trainer.resume=none",
        "trainer.progress_bar=false",
        "trainer.log_every=10",
        "trainer.placement=split",
        "trainer.max_staleness=1",
        "trainer.total_steps=60",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rewards = _rewards(str(out))
    k = max(1, len(rewards) // 10)
    last = sum(rewards[-k:]) / k
    assert last >= 0.8, (
        f"last-10% reward {last:.3f} < 0.8; reward/mean per step: {' '.join(f'{r:.2f}' for r in rewards)}"
    )
