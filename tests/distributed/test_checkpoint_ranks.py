"""Checkpoints on 2 real gloo ranks: resume is bit-exact (at an epoch boundary with optimizer
offload, and with dynamic sampling), each rank writes its own shards, and the export (one
process, no group) of the last checkpoint gives the full model."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow


def _resume_on_rank(rank: int, model_dir: str, out: str, extra: tuple):
    from tests.checkpoint_helpers import straight_and_resumed

    return straight_and_resumed(model_dir, out, 2, "data.batch_size=8", *extra, offload_copies=True), None


# 16 prompts = 2 batches of 8: the resume point (step 2) is exactly an epoch boundary; the optimizer
# state goes through the offload copies every step.
@pytest.mark.parametrize(
    "extra",
    [
        ("data.num_prompts=16", "offload.optimizer=true"),
        ("algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"),
        # Each rank carries its own unfinished samples (its rank file), and the ranks train as many groups each.
        ("rollout.partial=true", "trainer.max_staleness=2", "rollout.max_new_tokens=40"),
    ],
    ids=["epoch_boundary_offload", "dynamic_sampling", "partial_rollouts"],
)
def test_two_rank_resume_is_bit_exact(tiny_model_dir, tmp_path, extra):
    from tests.checkpoint_helpers import assert_same_run

    results = run_ranks(_resume_on_rank, world=2, args=(tiny_model_dir, str(tmp_path), extra), timeout=300)
    for rank, (result, _) in enumerate(results):
        assert_same_run(result)
        if "data.num_prompts=16" in extra:
            assert result["loader"][1]["epoch"] >= 1, "the run must cross the epoch boundary"
        if "rollout.partial=true" in extra:
            assert sum(m["rollout/continued"] for m in result["straight"]) > 0, "nothing carried across the resume"
    # The ranks trained different shards: a resume that loaded rank 0's shards on both would not pass above.
    w0, w1 = results[0][0]["resumed_weights"], results[1][0]["resumed_weights"]
    assert any(not torch.equal(w0[k], w1[k]) for k in w0 if w0[k].shape == w1[k].shape)
    ckpt_dir = os.path.join(results[0][0]["resumed_dir"], "checkpoints")
    newest = sorted(os.listdir(ckpt_dir))[-1]
    shards = sorted(f for f in os.listdir(os.path.join(ckpt_dir, newest, "state")) if f.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], f"each rank writes its own shard file: {shards}"
    assert sorted(f for f in os.listdir(os.path.join(ckpt_dir, newest)) if f.startswith("rank_")) == [
        "rank_00000.pt",
        "rank_00001.pt",
    ]
    # The export (one process, no group) of the 2-rank checkpoint is the full model the ranks hold.
    from hybrid_rl.checkpoint.export import export_checkpoint
    from hybrid_rl.models.loading import load_causal_lm

    export_checkpoint(ckpt_dir, str(tmp_path / "hf"))
    exported = load_causal_lm(str(tmp_path / "hf")).state_dict()
    full = results[0][0]["full_weights"]
    assert full and set(full) <= set(exported)
    for name, t in full.items():
        assert torch.equal(exported[name], t), name
