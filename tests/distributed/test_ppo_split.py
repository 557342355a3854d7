"""PPO with a critic in split placement (issue 36): the critic lives on the learners, the rollout rank holds no
critic. A 2-rank run of the real recipe under torchrun (1 learner, 1 rollout rank, one version of staleness):
critic metrics each step and the critic with its optimizer state in the learners' checkpoint.

Catches: the critic built on the rollout rank (its metrics would not reach the learner's log), the critic left
out of a split run's checkpoint, or a split run refusing the estimator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_split_ppo_trains_the_critic_on_the_learner(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from hybrid_rl.runtime.distributed import free_port

    out = tmp_path / "run"
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
        "trainer.placement=split",
        "trainer.rollout_ranks=1",
        "trainer.max_staleness=1",
        "algorithm.advantage=gae",
        "rollout.n=2",
        "data.batch_size=16",
        "algorithm.mini_batch_size=16",
        "trainer.total_steps=3",
        "trainer.save_every=3",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 3
    for row in rows:
        assert row["critic/vf_loss"] == row["critic/vf_loss"] and row["critic/grad_norm"] > 0, row
    saved = FileSystemReader(str(out / "checkpoints" / "step_00000003" / "state")).read_metadata()
    keys = set(saved.state_dict_metadata)
    assert any(k.startswith("critic.") for k in keys) and any(k.startswith("critic_optim.") for k in keys)
    assert any(k.startswith("model.") for k in keys)
