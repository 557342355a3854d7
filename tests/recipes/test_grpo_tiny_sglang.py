"""The demo recipe with rollout.engine=sglang (the CPU stand-in of sglang 0.5.21) under torchrun,
2 ranks, tp_size 1 and 2, learns.

SGLang starts its schedulers as child processes, so this runs under torchrun (a launcher with
daemonic workers cannot). The stand-in decodes for real in those processes and receives the
weights through shared-memory handles every step; the trainer compares the engine's
log-probs with its own every step (rollout/logp_mismatch).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 100


def _run(tmp_path, name: str, *overrides: str) -> list[dict]:
    from hybrid_rl.distributed import free_port

    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "fake_sglang"), ROOT])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           os.path.join(ROOT, "recipes", "grpo_tiny.py"), f"model.path={tmp_path / 'model'}", f"trainer.out_dir={out}",
           f"trainer.total_steps={STEPS}", "trainer.progress_bar=false", "trainer.log_every=50", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_recipe_with_sglang_learns(tmp_path, tp_size):
    """A short run must clearly improve; the full 300-step comparison with the native engine
    (same seed, different sampling streams) is in the README and the issue note: single runs
    of this task differ by up to ~0.1 in final reward, too noisy for a test's tolerance."""
    history = _run(tmp_path, f"tp{tp_size}", "rollout.engine=sglang", f"rollout.tp_size={tp_size}")
    assert len(history) == STEPS
    k = STEPS // 10
    first = sum(h["reward/mean"] for h in history[:k]) / k
    last = sum(h["reward/mean"] for h in history[-k:]) / k
    assert first <= 0.3 and last >= first + 0.1, f"tp{tp_size}: first 10% {first:.3f} -> last 10% {last:.3f}"
    assert max(h["rollout/logp_mismatch"] for h in history) < 1e-4, "engine vs trainer log-probs, fp32"
    assert all(h["switch/sync_weights_s"] > 0 for h in history), "weights are synced every step"
    assert all(h["memory/engine_weights_peak"] > 0 for h in history), "the ledger sees the engine's weights"
