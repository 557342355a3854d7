"""In-flight weight updates in the split placement (issue 37, trainer.inflight_update=continue; split/inflight.py) on
real gloo ranks: the rollout ranks take each version the learners make between two decode steps of the batch being
generated, over their own pair groups, and tag every token with the version that sampled it.

The rollout ranks' decode is slowed in the test (each poll sleeps a few ms, 24 tokens a batch), so the learner
finishes a step while a batch is still decoding: a version then lands mid-batch. Oracles: the schedule's bounds
(batch b is made by versions b - k .. b, staleness at the learner <= k), each completion's versions non-decreasing
and changing only where the rank took a version, and that some sample holds two versions; runs that must end
(several rollout ranks, learners on two ranks, a validation schedule, partial rollouts, a signal) end, none
waiting out a timeout."""

from __future__ import annotations

import os
import time
import traceback

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow
CONTINUE = (
    "trainer.placement=split",
    "trainer.inflight_update=continue",
    "trainer.dist_timeout_s=60",
    "rollout.max_new_tokens=24",
    "rollout.min_new_tokens=24",
)


def _slow_polls(seconds: float) -> None:
    from hybrid_rl.split import inflight

    poll = inflight.TakeOffered.poll

    def slow(self) -> int:
        time.sleep(seconds)
        return poll(self)

    inflight.TakeOffered.poll = slow


def _record_sends(log: list) -> None:
    """What each rollout rank sends: (batch, [(group version, per-completion token versions)])."""
    from hybrid_rl.split import rollout_loop

    send = rollout_loop.send_groups
    batch = {"b": 0}

    def recording(groups, *args, **kwargs):
        log.append((batch["b"], [(g.version, [g.versions_of(i) for i in range(len(g.completions))]) for g in groups]))
        batch["b"] += 1
        return send(groups, *args, **kwargs)

    rollout_loop.send_groups = recording


def _run(rank: int, model_dir: str, out: str, extra: tuple, poll_s: float) -> dict:
    try:
        from hybrid_rl import Trainer, load_config
        from tests.checkpoint_helpers import ROOT, overrides

        _slow_polls(poll_s)
        sent: list = []
        _record_sends(sent)
        cfg = load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides(model_dir, out, *CONTINUE, *extra))
        trainer = Trainer(cfg)
        history = trainer.fit()
        role = "rollout" if trainer.is_rollout else "learner"
        trainer.close()
        return {"role": role, "history": history, "sent": sent}
    except BaseException:  # noqa: BLE001 - the other rank's traceback is the useful one
        return {"error": traceback.format_exc()}


def _check(results: list[dict], k: int, steps: int) -> tuple[list[dict], list]:
    for r in reversed(results):  # a rollout rank's error first: the learner's is then a lost peer
        assert "error" not in r, r.get("error")
    learner = results[0]["history"]
    assert len(learner) == steps
    sends = [r["sent"] for r in results if r["role"] == "rollout"]
    mixed = 0
    for per_rank in sends:
        assert [b for b, _ in per_rank] == list(range(steps))
        for b, groups in per_rank:
            for version, completions in groups:
                firsts = [vs[0] for vs in completions if vs]
                assert version == min(firsts), "a group's version is its oldest token's"
                for vs in completions:
                    assert vs == sorted(vs), f"batch {b}: versions go back in a sample: {vs}"
                    assert all(max(0, b - k) <= v <= b for v in vs), f"batch {b} (k={k}) holds versions {vs}"
                    mixed += len(set(vs)) > 1
    assert max(m["split/staleness_max"] for m in learner) <= k
    return learner, sends, mixed


@pytest.mark.parametrize("world,rollout_ranks,lora", [(2, 1, False), (3, 2, False), (2, 1, True)])
def test_versions_land_between_decode_steps(tiny_model_dir, tmp_path, world, rollout_ranks, lora):
    """lora: every version is the adapters only (weight_sync's adapter sync), taken in flight all the same."""
    extra = (f"trainer.rollout_ranks={rollout_ranks}", "trainer.max_staleness=1", "trainer.total_steps=5")
    extra += ("model.lora.rank=4", "model.lora.alpha=8", "optim.lr=5e-2") if lora else ()
    results = run_ranks(_run, world=world, args=(tiny_model_dir, str(tmp_path), extra, 0.004), timeout=300)
    learner, sends, mixed = _check(results, k=1, steps=5)
    assert mixed > 0, "no sample holds tokens of two versions: no version landed mid-batch"
    taken = sum(m["split/inflight_updates"] for m in learner)
    assert taken > 0 and all(m["split/inflight_sync_s"] >= 0 for m in learner)


@pytest.mark.parametrize("partial_kv", ["recompute", "keep"])
def test_two_learners_validation_and_partial_rollouts(tiny_model_dir, tmp_path, partial_kv):
    """Learner ranks 0 and 1 gather every version together; validation after steps 2 and 4 takes its version before
    its batch (as drain does); partial rollouts carry samples whose new tokens keep their in-flight versions, their
    caches too with rollout.partial_kv=keep (versions taken mid-batch over kept rows: the bounds still hold)."""
    extra = (
        f"rollout.partial_kv={partial_kv}",
        "trainer.rollout_ranks=1",
        "trainer.max_staleness=2",
        "trainer.total_steps=4",
        "trainer.val_every=2",
        "data.val_split=0.1",
        "rollout.partial=true",
        "rollout.min_new_tokens=0",
        "algorithm.mini_batch_size=0",
    )
    results = run_ranks(_run, world=3, args=(tiny_model_dir, str(tmp_path), extra, 0.004), timeout=300)
    learner, _, _ = _check(results, k=2, steps=4)
    assert [m["val/weights_version"] for m in learner if "val/weights_version" in m] == [2.0, 4.0]
    kept = sum(m["rollout/continued_kept"] for m in learner if "rollout/continued_kept" in m)
    assert (kept > 0) == (partial_kv == "keep")


def _resume_and_stop(rank: int, model_dir: str, out: str) -> dict:
    """A run checkpointed after step 2 and resumed to step 4; then a run SIGINT-ed on the learner in step 2."""
    import signal

    from hybrid_rl import Trainer, load_config
    from hybrid_rl.runtime.stop import TrainingInterrupted
    from hybrid_rl.split import learner as learner_mod
    from hybrid_rl.split import rollout_loop
    from tests.checkpoint_helpers import ROOT, overrides

    def make(out_dir: str, *more: str):
        extra = ("trainer.rollout_ranks=1", "trainer.max_staleness=1", *more)
        return Trainer(
            load_config(
                os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides(model_dir, out_dir, *CONTINUE, *extra)
            )
        )

    try:
        _slow_polls(0.004)
        first = make(os.path.join(out, "resumed"), "trainer.total_steps=2", "trainer.save_every=2")
        first.fit()
        first.close()
        second = make(os.path.join(out, "resumed"), "trainer.total_steps=4")
        rest = second.fit()
        second.close()
        made, real_batch, real_after = [], rollout_loop.RolloutSide.batch, learner_mod.LearnerSide.after_update

        def batch(self, b):
            out = real_batch(self, b)
            made.append(b)
            return out

        def after_update(self, policy, version, batch_):
            if version == 2:
                signal.raise_signal(signal.SIGINT)
            return real_after(self, policy, version, batch_)

        rollout_loop.RolloutSide.batch, learner_mod.LearnerSide.after_update = batch, after_update
        interrupted = None
        try:
            make(os.path.join(out, "stopped"), "trainer.total_steps=6").fit()
        except TrainingInterrupted as stop:
            interrupted = stop.step
        return {"rest": rest, "made": made, "interrupted": interrupted}
    except BaseException:  # noqa: BLE001 - the other rank's traceback is the useful one
        return {"error": traceback.format_exc()}


def test_a_resume_and_a_signal_under_continue(tiny_model_dir, tmp_path):
    """The resumed run's first sync (version 2) and the STOP after a signal go through the sender threads as versions
    do: the resumed run trains steps 3 and 4 from version 2, and a SIGINT on the learner in step 2 ends the rollout
    rank's fit normally after batch 3 (k = 1), not at its 60 s timeout.
    Catches: a resume sync or a STOP sent over the old broadcast group (the rollout rank waits on its pair group),
    versions left queued at the end of a fit (the learner's finish() would hang)."""
    learner, rollout = run_ranks(_resume_and_stop, world=2, args=(tiny_model_dir, str(tmp_path)), timeout=300)
    for r in (rollout, learner):
        assert "error" not in r, r.get("error")
    assert [m["step"] for m in learner["rest"]] == [3, 4]
    assert learner["rest"][0]["split/weights_version"] == 2.0
    assert learner["interrupted"] == 2 and rollout["interrupted"] is None
    assert rollout["made"] == [0, 1, 2, 3], rollout["made"]
