"""Every algorithm preset trains the tiny digits demo for a short run without NaN or collapse.

One process, the recipe's YAML with `algorithm.preset=<name>` on top (the way a user selects
it), a small batch. Twenty steps are too few to expect a large gain from every method, so the
check is that nothing breaks: finite metrics, the reward does not fall, and the preset's own
machinery ran (its reference model, dynamic sampling, filters).
"""

from __future__ import annotations

import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, WINDOW, TOLERANCE = 20, 5, 0.03

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_one_thread")]


@pytest.mark.parametrize("preset", ["grpo", "drgrpo", "dapo", "gspo"])
def test_preset_short_run(tmp_path, tiny_model_dir, preset):
    from hybrid_rl import Trainer, load_config

    cfg = load_config(
        os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        [
            f"algorithm.preset={preset}",
            f"model.path={tiny_model_dir}",
            f"trainer.out_dir={tmp_path}",
            f"trainer.total_steps={STEPS}",
            "trainer.progress_bar=false",
            "trainer.log_every=0",
            "data.batch_size=16",
            "rollout.n=4",
            "trainer.device=cpu",
        ],
    )
    assert cfg.algorithm.preset == preset
    history = Trainer(cfg).fit()
    assert len(history) == STEPS
    for h in history:
        bad = {k: v for k, v in h.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {h['step']}: non-finite metrics {bad}"
    rewards = [h["reward/mean"] for h in history]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last >= first - TOLERANCE, f"{preset}: reward collapsed {first:.3f} -> {last:.3f}"
    trained = [h for h in history if "actor/grad_norm" in h]
    assert trained, "at least one step must train"
    assert ("actor/kl_loss" in trained[-1]) == (preset == "grpo"), "only GRPO has a KL term (in the loss)"
    if preset == "dapo":
        assert any(h["sampling/groups_filtered"] > 0 for h in history), "dynamic sampling must drop some groups"
        assert all("response/overlong_filtered" in h for h in trained)
    else:
        assert all(h["sampling/rounds"] == 1 and h["sampling/groups_kept"] == 16 for h in history)


def test_dapo_two_ranks_agree_on_the_kept_groups(tmp_path, tiny_model_dir):
    """Under torchrun with FSDP, ranks that keep different numbers of groups must still train in step.

    One sampling round and a 2-mini-batch split: the ranks filter different numbers of groups,
    truncate to the smallest, and run ragged mini-batches; a mismatch would hang or crash FSDP.
    """
    import json
    import subprocess
    import sys

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
        "algorithm.preset=dapo",
        "algorithm.max_sampling_rounds=1",
        "algorithm.mini_batch_size=32",
        "algorithm.kl_coef=0.01",
        "algorithm.kl_placement=reward",
        "algorithm.rollout_correction=tis_token",
        "data.batch_size=16",
        "rollout.n=4",
        "trainer.total_steps=6",
        "trainer.progress_bar=false",
        "trainer.dist_timeout_s=60",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(history) == 6
    for h in history:
        assert h["sampling/rounds"] == 1 and h["sampling/groups_kept"] % 2 == 0, "both ranks keep the same count"
        assert h["sampling/groups_kept"] + h["sampling/groups_filtered"] + h["sampling/groups_surplus"] == 16
    assert sum(h["sampling/groups_surplus"] for h in history) > 0, "some step needed the MIN truncation"
