"""A step that raises leaves the trainer usable: the phase switch is back in TRAIN (engine memory
released, optimizer and parameters back on the device, an interrupted SGLang weight sync closed) and
the loader at the failed step's first batch, so calling step() again retries the same step. A closed
trainer refuses to step."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl import Trainer, load_config
from hybrid_rl.rewards.toy import digits_reward
from hybrid_rl.switch.phases import Phase

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class FlakyReward:
    """digits_reward that raises once when `fail` is set; records the prompts of every whole-batch call
    (compute_rewards calls again one completion at a time to name the one that fails)."""

    def __init__(self):
        self.fail, self.batches = False, []

    def __call__(self, prompts, completions, metadata):
        if len(prompts) > 1:
            self.batches.append(list(prompts))
        if self.fail:
            self.fail = False
            raise ValueError("reward server hiccup")
        return digits_reward(prompts, completions, metadata)


def _between_steps(tr) -> None:
    pm = tr.phases
    assert pm.phase is Phase.TRAIN and pm.inside is None
    assert pm.opt_offload is None or pm.opt_offload.on_device
    assert tr.engine.memory_bytes()["kv_cache"] == 0 or not tr.engine._kv_ready


@pytest.mark.parametrize("extra", [(), ("offload.optimizer=true",)], ids=["plain", "optimizer_offload"])
def test_a_failing_reward_is_retried_on_the_same_prompts(tiny_trainer_overrides, extra):
    reward = FlakyReward()
    tr = Trainer(load_config(None, [*tiny_trainer_overrides, "trainer.total_steps=3", *extra]), reward_fn=reward)
    tr.step()
    reward.fail = True
    with pytest.raises(RuntimeError, match="hiccup"):
        tr.step()
    _between_steps(tr)
    assert tr.step_idx == 1
    failed = reward.batches[-1]
    m = tr.step()
    assert m["step"] == 2 and tr.step_idx == 2
    assert reward.batches[-1] == failed, "the retry draws the failed step's prompts again"
    _between_steps(tr)


def test_failures_in_score_and_while_entering_rollout(tiny_trainer_overrides, monkeypatch):
    tr = Trainer(load_config(None, [*tiny_trainer_overrides, "offload.optimizer=true", "trainer.total_steps=3"]))
    real_score, real_resume = tr._score, tr.engine.resume

    def score_fails(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(tr, "_score", score_fails)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        tr.step()
    assert tr.phases.opt_offload.on_device, "the optimizer left the device for ROLLOUT and is back"
    assert tr.phases.failed_phase is Phase.SCORE, "the failure report names where it failed, not TRAIN"
    _between_steps(tr)
    monkeypatch.setattr(tr, "_score", real_score)

    def resume_fails(tags):
        if "kv_cache" in tags:
            raise KeyboardInterrupt  # Ctrl-C in a notebook while the engine's memory comes back
        real_resume(tags)

    monkeypatch.setattr(tr.engine, "resume", resume_fails)
    with pytest.raises(KeyboardInterrupt):
        tr.step()
    _between_steps(tr)
    monkeypatch.setattr(tr.engine, "resume", real_resume)
    assert tr.step()["step"] == 1
    assert tr.phases.failed_phase is None


def test_validation_that_fails_returns_to_train(tiny_trainer_overrides):
    reward = FlakyReward()
    tr = Trainer(
        load_config(None, [*tiny_trainer_overrides, "data.num_prompts=40", "data.val_split=0.2"]), reward_fn=reward
    )
    reward.fail = True
    with pytest.raises(RuntimeError, match="hiccup"):
        tr.validator.run(0)
    _between_steps(tr)
    assert "val/pass@1" in tr.validator.run(0)
    assert tr.step()["step"] == 1


def test_a_closed_trainer_refuses_to_step(tiny_trainer_overrides):
    tr = Trainer(load_config(None, tiny_trainer_overrides))
    tr.close()
    tr.close()
    with pytest.raises(RuntimeError, match="closed.*build a new Trainer"):
        tr.step()
    with pytest.raises(RuntimeError, match="closed"):
        tr.fit()


def test_an_sglang_sync_that_fails_midway_is_closed_and_resent(tiny_model_dir, fake_sglang):
    """The stand-in runs the real transport: a bucket that fails leaves SGLang inside its weight-update
    session; recover() closes it and releases the weights, and the next rollout sends every parameter."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
    from hybrid_rl.switch.phases import PhaseManager
    from hybrid_rl.types import SamplingParams

    tok = load_tokenizer(tiny_model_dir)
    policy = load_causal_lm(tiny_model_dir)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    engine = SGLangEngine(policy, tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=1)
    try:
        pm = PhaseManager(policy, opt, engine, torch.device("cpu"), bucket_bytes=16 << 10)
        real_update, sent = engine.update_weights, []

        def update_fails_on_the_third_bucket(bucket):
            bucket = list(bucket)
            sent.append(len(bucket))
            if len(sent) == 3:
                raise ConnectionError("scheduler went away (simulated)")
            real_update(bucket)

        engine.update_weights = update_fails_on_the_third_bucket
        with pytest.raises(ConnectionError):
            with pm.rollout():
                pass
        assert engine.engine._debug_state()["session_active"]
        pm.recover()
        assert not engine.engine._debug_state()["session_active"] and not engine.session
        assert pm.phase is Phase.TRAIN and engine.released == {"weights", "kv_cache"}
        engine.update_weights = real_update
        params = SamplingParams(max_new_tokens=4, greedy=True)
        with pm.rollout() as eng:
            out = eng.generate([[5, 6, 7, 14]], params)
        with pm.train():
            pass
        assert len(out) == 1 and engine._sent == set(engine.expected), "the next sync sent every parameter"
    finally:
        engine.shutdown()


def test_ctrl_c_during_an_sglang_call_waits_for_it(tiny_model_dir, fake_sglang):
    """SIGINT while SGLang resumes its weights: the call completes (SGLang would finish it anyway), this
    side's bookkeeping follows it, and only then KeyboardInterrupt is raised; recover() then releases what
    is really resident, and the next rollout works. Cut off mid-call, the weights would stay resident while
    the engine thinks them released, and the next resume would kill SGLang."""
    import os
    import signal

    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
    from hybrid_rl.switch.phases import PhaseManager
    from hybrid_rl.types import SamplingParams

    tok = load_tokenizer(tiny_model_dir)
    policy = load_causal_lm(tiny_model_dir)
    engine = SGLangEngine(policy, tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=1)
    # Python's own Ctrl-C handler, whatever started pytest (a shell's background job inherits SIGINT ignored).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        pm = PhaseManager(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), engine, torch.device("cpu"))
        real = engine.engine.resume_memory_occupation

        def resume_hit_by_ctrl_c(tags):
            os.kill(os.getpid(), signal.SIGINT)
            return real(tags)

        engine.engine.resume_memory_occupation = resume_hit_by_ctrl_c
        with pytest.warns(UserWarning, match="interrupt held"), pytest.raises(KeyboardInterrupt):
            with pm.rollout():
                pass
        engine.engine.resume_memory_occupation = real
        assert (
            "weights" not in engine.released
            and "weights" not in engine.engine._debug_state()["ranks"][0]["offload_tags"]
        )
        pm.recover()
        assert engine.released == {"weights", "kv_cache"} and pm.phase is Phase.TRAIN
        with pm.rollout() as eng:
            assert len(eng.generate([[5, 6, 7, 14]], SamplingParams(max_new_tokens=3, greedy=True))) == 1
        with pm.train():
            pass
    finally:
        signal.signal(signal.SIGINT, outer)
        engine.shutdown()
