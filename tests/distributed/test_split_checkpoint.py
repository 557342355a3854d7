"""Checkpoints and stopping in the split placement (hybrid_rl/split/), on 2 gloo ranks: rank 0 learns, rank 1
generates. One launch runs every config in order (each returns its result or its traceback):
  resume        k=0: 4 steps straight, against 2 steps + checkpoint + a new Trainer resumed for 2 more; the
                reward draws from the global RNGs on the rollout rank (tests/checkpoint_helpers.noisy_digits);
  stop_learner  k=1, 6 steps: SIGINT on the learner during step 2;
  stop_rollout  k=1, 6 steps: SIGINT on the rollout rank inside its reward (the learners hear of it with the
                batch's report).
"""

from __future__ import annotations

import os
import signal
import traceback

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow
CLOCK = ("split/bottleneck", "split/tokens_generated_per_s", "split/tokens_trained_per_s")
SPLIT = ("trainer.placement=split", "trainer.rollout_ranks=1", "trainer.dist_timeout_s=60")


def _resume(model_dir: str, out: str) -> dict:
    from hybrid_rl import Trainer, load_config
    from tests.checkpoint_helpers import ROOT, comparable, overrides, weights

    def make(out_dir: str, *more: str):
        cfg = load_config(
            os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
            overrides(model_dir, out_dir, *SPLIT, "trainer.max_staleness=0", *more),
        )
        return Trainer(cfg)

    straight = make(os.path.join(out, "straight"), "trainer.total_steps=4")
    full = straight.fit()
    first = make(os.path.join(out, "resumed"), "trainer.total_steps=2", "trainer.save_every=2")
    first.fit()
    first.close()
    second = make(os.path.join(out, "resumed"), "trainer.total_steps=4")
    rest = second.fit()
    if second.is_rollout:
        return {}
    return {
        "straight": [comparable(m) for m in full[2:]],
        "resumed": [comparable(m) for m in rest],
        "straight_weights": weights(straight),
        "resumed_weights": weights(second),
        "loader": (straight.state.loader.state_dict(), second.state.loader.state_dict()),
    }


def _stop(model_dir: str, out: str, where: str) -> dict:
    """fit(6) with a SIGINT raised on `where`'s rank; what each rank saw."""
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.runtime.stop import TrainingInterrupted
    from hybrid_rl.split import learner as learner_mod
    from hybrid_rl.split import rollout_loop
    from tests import checkpoint_helpers as helpers

    extra = ["trainer.max_staleness=1", "trainer.total_steps=6"]
    if where == "rollout":
        extra.append("reward.fn=tests.checkpoint_helpers:interrupting_digits")
        helpers.CALLS.update(n=0, signal_at=3)  # call 1 is the start-up probe: the signal comes in batch 1
    cfg = load_config(
        os.path.join(helpers.ROOT, "recipes", "grpo_tiny.yaml"), helpers.overrides(model_dir, out, *SPLIT, *extra)
    )
    made, real_batch, real_after = [], rollout_loop.RolloutSide.batch, learner_mod.LearnerSide.after_update

    def batch(self, b):
        out = real_batch(self, b)
        made.append(b)  # sent (a STOP in its weights wait raises before)
        return out

    def after_update(self, policy, version, batch_):
        if where == "learner" and version == 2:
            signal.raise_signal(signal.SIGINT)
        return real_after(self, policy, version, batch_)

    rollout_loop.RolloutSide.batch, learner_mod.LearnerSide.after_update = batch, after_update
    try:
        tr = Trainer(cfg)
        tr.fit()
        return {"interrupted": None, "made": made}
    except TrainingInterrupted as stop:
        return {"interrupted": (stop.step, stop.checkpoint), "made": made}
    finally:
        rollout_loop.RolloutSide.batch, learner_mod.LearnerSide.after_update = real_batch, real_after
        helpers.CALLS.update(n=0, signal_at=0)


def _rank(rank: int, model_dir: str, out: str) -> dict:
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    results = {}
    for name, fn in (
        ("resume", lambda: _resume(model_dir, os.path.join(out, "resume"))),
        ("stop_learner", lambda: _stop(model_dir, os.path.join(out, "stop_learner"), "learner")),
        ("stop_rollout", lambda: _stop(model_dir, os.path.join(out, "stop_rollout"), "rollout")),
    ):
        try:
            results[name] = fn()
        except BaseException:  # noqa: BLE001 - this config's test reports it
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    return run_ranks(_rank, world=2, args=(tiny_model_dir, str(tmp_path_factory.mktemp("split_ckpt"))), timeout=600)


def _result(runs, name: str, rank: int) -> dict:
    r = runs[rank][name]
    if isinstance(r, str):
        pytest.fail(f"split config {name} failed on rank {rank}:\n{r}")
    return r


def test_k0_resume_is_bit_exact(runs):
    """Catches: a resumed run whose rollout rank starts at another loader position or batch index, other
    sampling seeds or reward RNG state after the resume (the rollout rank checkpoints nothing), or weights
    not sent at the resume (the rollout rank would generate with version 0)."""
    from tests.checkpoint_helpers import assert_same_run

    r = dict(_result(runs, "resume", 0))
    for key in ("straight", "resumed"):  # the split pools' wall-clock metrics are noise too
        r[key] = [
            {k: v for k, v in m.items() if not (k.startswith("split/") and (k.endswith("_s") or k in CLOCK))}
            for m in r[key]
        ]
    assert r["straight"][0]["split/weights_version"] == 2.0
    assert_same_run(r)
    _result(runs, "resume", 1)


@pytest.mark.parametrize("where", ["learner", "rollout"])
def test_a_signal_stops_both_pools_after_a_checkpoint(runs, where):
    """A SIGINT on either pool: the learner stops after step 2 with a checkpoint, and the rollout rank's loop
    ends then (told STOP), not at its 60 s timeout (which would make it raise here).
    Catches: no STOP sent (the rollout rank waits for weights that never come), the batch made with the last
    sent weights left unreceived (the rollout rank blocked in its send), a rollout rank's signal not reaching
    the learners (the run goes on to step 6), a rollout rank killed by its first signal."""
    learner, rollout = _result(runs, f"stop_{where}", 0), _result(runs, f"stop_{where}", 1)
    assert learner["interrupted"] is not None, "the learner did not stop on the signal"
    step, path = learner["interrupted"]
    assert step == 2 and os.path.isdir(path), learner["interrupted"]
    assert rollout["interrupted"] is None, "the rollout rank's fit must end normally on STOP"
    assert rollout["made"] == [0, 1, 2, 3], rollout["made"]  # k=1: batch 3 is made with version 2, then STOP
