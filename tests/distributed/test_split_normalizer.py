"""The reward model's running normaliser (reward.normalize_model) in the split placement, on 2 gloo ranks: rank 0
learns, rank 1 generates and scores (the normaliser updates there). One launch runs both configs in order (each
returns its result or its traceback):
  resume  k=0: 4 steps straight, against 2 steps + checkpoint + a new Trainer resumed for 2 more (the reward
          also draws from the global RNGs, tests/checkpoint_helpers.noisy_digits);
  ahead   k=1, 3 steps, a checkpoint after step 2: the rollout rank has made batch 2 by then (it runs one batch
          ahead), and the checkpoint must hold the normaliser as of batch 1, the last one trained.
The oracle of `ahead` is the rollout rank's own normaliser, read after each batch it sends (a spy on
RolloutSide.batch), not the report the learners receive; `resume` compares two runs of the same code, so what
both get wrong alike (the normaliser's arithmetic) is tests/unit/rewards' (RunningNorm against a naive pass).
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow
CLOCK = ("split/bottleneck", "split/tokens_generated_per_s", "split/tokens_trained_per_s")
SPLIT = ("trainer.placement=split", "trainer.rollout_ranks=1", "trainer.dist_timeout_s=60")


def _norm_overrides(rm_dir: str) -> tuple[str, ...]:
    return (
        f"reward.model_path={rm_dir}",
        "reward.normalize_model=true",
        "reward.weights.rule=1",
        "reward.weights.model=0.5",
        "reward.max_tokens_per_micro_batch=16",
    )


def _make(model_dir: str, rm_dir: str, out_dir: str, *more: str):
    from hybrid_rl import Trainer, load_config
    from tests.checkpoint_helpers import ROOT, overrides

    cfg = load_config(
        os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        overrides(model_dir, out_dir, *SPLIT, *_norm_overrides(rm_dir), *more),
    )
    return Trainer(cfg)


def _resume(model_dir: str, rm_dir: str, out: str) -> dict:
    from tests.checkpoint_helpers import comparable, weights

    k0 = "trainer.max_staleness=0"
    straight = _make(model_dir, rm_dir, os.path.join(out, "straight"), k0, "trainer.total_steps=4")
    full = straight.fit()
    first = _make(model_dir, rm_dir, os.path.join(out, "resumed"), k0, "trainer.total_steps=2", "trainer.save_every=2")
    first.fit()
    first.close()
    second = _make(model_dir, rm_dir, os.path.join(out, "resumed"), k0, "trainer.total_steps=4")
    rest = second.fit()
    # Each rank's normaliser: the rollout rank's updates, the learner's is the run state's (what a checkpoint saves).
    norms = (straight.rewards.norm.state_dict(), second.rewards.norm.state_dict())
    if second.is_rollout:
        return {"norm": norms}
    return {
        "straight": [comparable(m) for m in full[2:]],
        "resumed": [comparable(m) for m in rest],
        "straight_weights": weights(straight),
        "resumed_weights": weights(second),
        "loader": (straight.state.loader.state_dict(), second.state.loader.state_dict()),
        "norm": norms,
        "run_state_is_the_norm": straight.state.reward_norm is straight.rewards.norm,
    }


def _ahead(model_dir: str, rm_dir: str, out: str) -> dict:
    from hybrid_rl.checkpoint import sharded as ckpt
    from hybrid_rl.split import rollout_loop

    after_batch, real_batch = {}, rollout_loop.RolloutSide.batch

    def batch(self, b):
        real_batch(self, b)
        after_batch[b] = dict(self.norm.state_dict())

    rollout_loop.RolloutSide.batch = batch
    try:
        tr = _make(model_dir, rm_dir, out, "trainer.max_staleness=1", "trainer.total_steps=3", "trainer.save_every=2")
        tr.fit()
    finally:
        rollout_loop.RolloutSide.batch = real_batch
    if tr.is_rollout:
        return {"after_batch": after_batch}
    saved = {
        step: torch.load(os.path.join(path, "rank_00000.pt"), weights_only=False)["reward_norm"]
        for step, path in ckpt.checkpoint_dirs(tr.cfg.trainer.checkpoint_root)
    }
    return {"saved": saved}


def _rank(rank: int, model_dir: str, rm_dir: str, out: str) -> dict:
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    results = {}
    for name, fn in (
        ("resume", lambda: _resume(model_dir, rm_dir, os.path.join(out, "resume"))),
        ("ahead", lambda: _ahead(model_dir, rm_dir, os.path.join(out, "ahead"))),
    ):
        try:
            results[name] = fn()
        except BaseException:  # noqa: BLE001 - this config's test reports it
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    from hybrid_rl.rewards.tiny_model import random_reward_model_dir

    out = tmp_path_factory.mktemp("split_norm")
    rm_dir = random_reward_model_dir(str(out / "rm"))
    return run_ranks(_rank, world=2, args=(tiny_model_dir, rm_dir, str(out)), timeout=600)


def _result(runs, name: str, rank: int) -> dict:
    r = runs[rank][name]
    if isinstance(r, str):
        pytest.fail(f"split config {name} failed on rank {rank}:\n{r}")
    return r


def test_k0_resume_with_the_normaliser_is_bit_exact_and_restores_it(runs):
    """Catches: the normaliser left out of the batch report or the start message (the resumed rollout rank would
    normalise from a fresh start: other rewards, other weights), or not stored in the learners' run state (the
    checkpoint would carry a fresh one)."""
    from tests.checkpoint_helpers import assert_same_run

    learner, rollout = dict(_result(runs, "resume", 0)), _result(runs, "resume", 1)
    for key in ("straight", "resumed"):  # the split pools' wall-clock metrics are noise too
        learner[key] = [
            {k: v for k, v in m.items() if not (k.startswith("split/") and (k.endswith("_s") or k in CLOCK))}
            for m in learner[key]
        ]
    assert "reward/model_norm_mean" in learner["straight"][0], "the run does not normalise the model's scores"
    assert_same_run(learner)
    assert learner["run_state_is_the_norm"]
    straight, resumed = rollout["norm"]
    assert straight["count"] == 4 * 4 * 4, straight  # 4 batches of 4 prompts x 4 samples, all scored
    assert resumed == straight, "the rollout rank's normaliser after the resume differs from the straight run's"
    assert learner["norm"] == (straight, straight), "the learner's run state does not hold the rollout's normaliser"


def test_a_checkpoint_holds_the_normaliser_of_the_last_trained_batch_not_of_the_batches_made_ahead(runs):
    """k=1: when the learner saves after step 2 the rollout rank has scored batch 2 already.
    Catches: the learner keeping the newest report's normaliser (batch 2's) instead of the trained batch's."""
    saved = _result(runs, "ahead", 0)["saved"]
    after_batch = _result(runs, "ahead", 1)["after_batch"]
    assert sorted(after_batch) == [0, 1, 2] and sorted(saved) == [2, 3]
    assert after_batch[1] != after_batch[2], "the test needs batches that move the normaliser"
    assert saved[2] == after_batch[1]
    assert saved[3] == after_batch[2]
