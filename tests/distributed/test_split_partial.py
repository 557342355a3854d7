"""Partial rollouts in the split placement (issue 37; split/roles.schedule_k), on 2 gloo ranks: rank 0 learns,
rank 1 generates. With trainer.max_staleness=1 the rollout rank makes batch b with version b (schedule k = 0), stops
once the batch's groups are done and carries the rest; a carried sample continues in batch b + 1 under version
b + 1, each token tagged with its own version, and reaches the loss at most 1 version old. Its carried samples travel
to learner rank 0 with each report and into the checkpoint: a resumed run continues them, to the bit.

Oracles: the straight run against the resumed one; the staleness the learner measured against the rule's bound."""

from __future__ import annotations

import os
import traceback

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow
CLOCK = ("split/bottleneck", "split/tokens_generated_per_s", "split/tokens_trained_per_s")
PARTIAL = (
    "trainer.placement=split",
    "trainer.rollout_ranks=1",
    "trainer.dist_timeout_s=60",
    "trainer.max_staleness=1",
    "rollout.partial=true",
    "rollout.max_new_tokens=40",
)


def _resume(rank: int, model_dir: str, out: str) -> dict:
    try:
        from hybrid_rl import Trainer, load_config
        from tests.checkpoint_helpers import ROOT, comparable, overrides, weights

        def make(out_dir: str, *more: str):
            return Trainer(
                load_config(
                    os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides(model_dir, out_dir, *PARTIAL, *more)
                )
            )

        straight = make(os.path.join(out, "straight"), "trainer.total_steps=4")
        full = straight.fit()
        first = make(os.path.join(out, "resumed"), "trainer.total_steps=2", "trainer.save_every=2")
        first.fit()
        carried = first.state.partial.carried_samples() if not first.is_rollout else None
        first.close()
        second = make(os.path.join(out, "resumed"), "trainer.total_steps=4")
        rest = second.fit()
        if second.is_rollout:
            return {}
        return {
            "history": full,
            "straight": [comparable(m) for m in full[2:]],
            "resumed": [comparable(m) for m in rest],
            "straight_weights": weights(straight),
            "resumed_weights": weights(second),
            "loader": (straight.state.loader.state_dict(), second.state.loader.state_dict()),
            "carried_at_checkpoint": carried,
        }
    except BaseException:  # noqa: BLE001 - the other rank's traceback is the useful one
        return {"error": traceback.format_exc()}


def test_carried_samples_continue_across_batches_and_a_resume(tiny_model_dir, tmp_path):
    from tests.checkpoint_helpers import assert_same_run

    results = run_ranks(_resume, world=2, args=(tiny_model_dir, str(tmp_path)), timeout=600)
    for r in reversed(results):  # the rollout rank's error first: the learner's is then a lost peer
        assert "error" not in r, r.get("error")
    learner = results[0]
    history = learner["history"]
    assert sum(m["rollout/continued"] for m in history) > 0, "no sample was carried to a later batch"
    assert max(m["rollout/version_span_max"] for m in history) >= 1, "no trained sample holds two versions"
    assert max(m["split/staleness_max"] for m in history) <= 1  # the rule's k
    assert learner["carried_at_checkpoint"] > 0, "the checkpoint at step 2 carries nothing: the resume tests nothing"
    for key in ("straight", "resumed"):  # the split pools' wall-clock metrics are noise
        learner[key] = [
            {k: v for k, v in m.items() if not (k.startswith("split/") and (k.endswith("_s") or k in CLOCK))}
            for m in learner[key]
        ]
    assert_same_run(learner)


def _keep(rank: int, model_dir: str, out: str) -> dict:
    """rollout.partial_kv=keep on the rollout rank: 4 batches straight, then 2 + a resume from the checkpoint at 2."""
    try:
        from hybrid_rl import Trainer, load_config
        from tests.checkpoint_helpers import ROOT, overrides

        def make(out_dir: str, *more: str):
            extra = (*PARTIAL, "rollout.partial_kv=keep", *more)
            return Trainer(
                load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides(model_dir, out_dir, *extra))
            )

        straight = make(os.path.join(out, "straight"), "trainer.total_steps=4")
        full = straight.fit()
        first = make(os.path.join(out, "resumed"), "trainer.total_steps=2", "trainer.save_every=2")
        first.fit()
        saved = None if first.is_rollout else first.state.partial.state_dict()
        first.close()
        second = make(os.path.join(out, "resumed"), "trainer.total_steps=4")
        rest = second.fit()
        return {"history": full, "rest": rest, "saved": saved, "rollout": second.is_rollout}
    except BaseException:  # noqa: BLE001 - the other rank's traceback is the useful one
        return {"error": traceback.format_exc()}


def test_kept_caches_on_a_rollout_rank_stay_there_and_a_resume_re_prefills_once(tiny_model_dir, tmp_path):
    """The rollout rank continues carried samples over their kept caches (rollout/continued_kept, reported to the
    learner); the pool state it reports, which the learners checkpoint, holds none of them (no tensor crosses to the
    learners); the resumed run's first batch re-prefills its carried samples (none kept), later batches keep again.
    Catches: caches sent with every report, a resumed rollout rank waiting for caches the checkpoint never had."""
    results = run_ranks(_keep, world=2, args=(tiny_model_dir, str(tmp_path)), timeout=600)
    for r in reversed(results):
        assert "error" not in r, r.get("error")
    learner = results[0]
    history, rest = learner["history"], learner["rest"]
    assert sum(m["rollout/continued_kept"] for m in history) > 0, "no carried sample continued over its cache"
    assert max(m["split/staleness_max"] for m in history) <= 1
    pools = learner["saved"]["rollout_ranks"]
    samples = [s for pool in pools for g in pool["groups"] for s in g["samples"]]
    assert samples and all(s["kv"] is None for s in samples)
    assert rest[0]["rollout/continued"] > 0 and rest[0]["rollout/continued_kept"] == 0
    assert sum(m["rollout/continued_kept"] for m in rest[1:]) > 0
