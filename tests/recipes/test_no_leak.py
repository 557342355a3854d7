"""No leak: over 100 steps of the tiny demo with a checkpoint every 10 steps, what is held after
step k equals what was held after step 1."""

from __future__ import annotations

import gc
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _live_tensors() -> tuple[int, int]:
    gc.collect()
    ts = [o for o in gc.get_objects() if torch.is_tensor(o)]
    return len(ts), sum(t.numel() * t.element_size() for t in ts)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_memory_after_step_k_equals_step_1(tiny_model_dir, tmp_path):
    from hybrid_rl import Trainer, load_config

    cfg = load_config(
        os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        [
            f"model.path={tiny_model_dir}",
            f"trainer.out_dir={tmp_path}",
            "trainer.progress_bar=false",
            "data.batch_size=8",
            "rollout.n=4",
            "offload.optimizer=true",
            "trainer.keep_last=1",
        ],
    )
    trainer = Trainer(cfg)
    ledger = trainer.phases.ledger
    trainer.step()
    held_after_1 = {s.label: s.roles for s in ledger.rollout_snapshots(1)}["train:end"]
    first_tensors = _live_tensors()
    trainer.step()  # step 1 starts without optimizer state; from step 2 every boundary repeats
    first_roles = {s.label: s.roles for s in ledger.rollout_snapshots(2)}
    trainer.save_checkpoint()  # the first save builds what every later one reuses
    assert first_roles["train:end"] == held_after_1
    rss = {}
    for k in range(3, 101):
        trainer.step()
        roles = {s.label: s.roles for s in ledger.rollout_snapshots(k)}
        assert roles == first_roles, f"step {k}: resident bytes per role changed"
        if k % 10 == 0:
            trainer.save_checkpoint()
        if k in (10, 50, 100):
            assert _live_tensors() == first_tensors, f"step {k}: live tensors (count, bytes) changed"
            rss[k] = _rss()
    assert len(ledger.snapshots) <= 2 * len(first_roles), "the ledger must not grow with the run"
    # The process as a whole: allocator noise only (a leaked KV cache or state copy per step is larger).
    assert rss[100] - rss[10] < 8 << 20, f"RSS grew {(rss[100] - rss[10]) / 1e6:.1f} MB from step 10 to 100"
