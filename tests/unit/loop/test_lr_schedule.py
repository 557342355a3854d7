"""The learning-rate schedule: warm-up then constant / cosine / linear decay to lr * min_lr_ratio,
against the formulas written out, and the Trainer's optimizer steps under it."""

from __future__ import annotations

import math

import pytest

from hybrid_rl.config.load import load_config
from hybrid_rl.loop.lr_schedule import lr_factor, optimizer_steps
from hybrid_rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _naive(s, warmup, total, kind, floor):
    if s < warmup:
        return (s + 1) / warmup
    if kind == "constant":
        return 1.0
    t = (s - warmup) / (total - 1 - warmup)  # 0 at the first step after warm-up, 1 at the run's last
    t = min(t, 1.0)
    shape = (1 + math.cos(math.pi * t)) / 2 if kind == "cosine" else 1 - t
    return floor + (1 - floor) * shape


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup,total,floor", [(0, 10, 0.0), (3, 12, 0.1), (2, 7, 0.5)])
def test_factor_matches_the_formula(kind, warmup, total, floor):
    for s in range(total + 3):  # past the end: the floor stays
        assert lr_factor(s, warmup, total, kind, floor) == pytest.approx(_naive(s, warmup, total, kind, floor))


def test_decay_ends_at_the_floor_on_the_last_step():
    assert lr_factor(0, 0, 5, "cosine", 0.1) == 1.0
    assert lr_factor(4, 0, 5, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(1, 2, 3, "linear", 0.0) == 1.0  # warm-up ends exactly at the last step: no decay yet


def test_optimizer_steps_counts_epochs_and_mini_batches():
    assert optimizer_steps(10, 64, 0, 1) == 10
    assert optimizer_steps(10, 64, 16, 2) == 80


def test_bad_schedule_is_rejected(tiny_trainer_overrides):
    with pytest.raises(ValueError, match="optim.lr_schedule"):
        load_config(None, [*tiny_trainer_overrides, "optim.lr_schedule=exp"])
    with pytest.raises(ValueError, match="optim.min_lr_ratio"):
        load_config(None, [*tiny_trainer_overrides, "optim.min_lr_ratio=2"])


def test_trainer_decays_to_the_floor_over_the_run(tiny_trainer_overrides):
    """2 GRPO steps x 2 mini-batches = 4 optimizer steps; actor/lr is the mean over a step's updates."""
    cfg = load_config(
        None,
        [
            *tiny_trainer_overrides,
            "trainer.total_steps=2",
            "algorithm.mini_batch_size=4",
            "optim.lr=1e-3",
            "optim.lr_schedule=cosine",
            "optim.min_lr_ratio=0.1",
        ],
    )
    tr = Trainer(cfg)
    lrs = [_naive(s, 0, 4, "cosine", 0.1) * 1e-3 for s in range(4)]
    for k in range(2):
        m = tr.step()
        assert m["actor/lr"] == pytest.approx((lrs[2 * k] + lrs[2 * k + 1]) / 2, rel=1e-6)
    tr.close()
