"""The Trainer with an environment (issue 28), on the tiny ask-then-answer task: what it trains, what it refuses
before the first step, validation over episodes, and a bit-exact resume mid-run.

Catches: a masked-in token that the engine did not generate (observation tokens in the loss, a turn
re-tokenized, prompts and episodes paired wrongly), a bad env.* / rollout.max_episode_tokens setting found
only at the first step (or not at all), validation that generates single turns, a resume whose episodes differ.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hybrid_rl import Trainer, load_config
from hybrid_rl.envs.base import EnvError

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ask_dir(tmp_path_factory):
    from hybrid_rl.envs.tiny_ask import ask_rows, build_ask_model_dir

    root = tmp_path_factory.mktemp("ask")
    build_ask_model_dir(str(root / "model"))
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ask_rows(64, seed=0)))
    return root


def _cfg(root, out, *extra):
    return load_config(
        None,
        [
            f"model.path={root / 'model'}",
            "data.task=jsonl",
            f"data.path={root / 'rows.jsonl'}",
            "env.name=tiny_ask",
            "rollout.max_turns=2",
            "rollout.max_new_tokens=2",
            "rollout.max_episode_tokens=32",
            "rollout.n=4",
            "data.batch_size=4",
            "trainer.total_steps=2",
            "optim.lr=3e-3",
            f"trainer.out_dir={out}",
            "trainer.progress_bar=false",
            "trainer.log_every=0",
            "trainer.device=cpu",
            *extra,
        ],
    )


def test_every_trained_token_is_one_the_engine_generated(ask_dir, tmp_path, monkeypatch):
    import hybrid_rl.envs.episodes as episodes_mod
    import hybrid_rl.trainer as trainer_mod

    seen_episodes, seen_batches = [], []
    run, update = episodes_mod.EpisodeRunner.run, trainer_mod.policy_update

    def spy_run(self, rows, G, params):
        out = run(self, rows, G, params)
        seen_episodes.append(out)
        return out

    def spy_update(**kw):
        seen_batches.append(kw["batch"])
        return update(**kw)

    monkeypatch.setattr(episodes_mod.EpisodeRunner, "run", spy_run)
    monkeypatch.setattr(trainer_mod, "policy_update", spy_update)
    trainer = Trainer(_cfg(ask_dir, tmp_path))
    history = trainer.fit()
    assert len(seen_episodes) == len(seen_batches) == 2
    holes = 0
    for eps, tb in zip(seen_episodes, seen_batches):
        assert len(eps) == len(tb)
        for i, ep in enumerate(eps):
            row = tb.ids_NL[i][tb.attn_NL[i] == 1].tolist()
            assert row == ep.token_ids, f"episode {i}: the batch row is not the episode's tokens"
            # ep.loss_mask is the runner's, not the batch's: tests/unit/envs/test_episodes.py replays it against
            # the engine's own calls, so comparing the batch with it compares with an independent record.
            trained = tb.ids_NL[i, tb.P :][tb.mask_NT[i] == 1].tolist()
            generated = [t for t, m in zip(ep.response_ids, ep.loss_mask) if m]
            assert trained == generated and sum(ep.loss_mask) == len(generated)
            holes += ep.observation_tokens
    assert holes > 0, "no episode had an observation: the test would not see a leak"
    for key in (
        "episode/turns",
        "episode/tokens",
        "episode/observation_tokens",
        "episode/end_done",
        "episode/end_max_turns",
        "episode/end_max_episode_tokens",
        "episode/end_timeout",
    ):
        assert key in history[-1], key


def _refused(cfg_or_args, match, exc=ValueError):
    with pytest.raises(exc, match=match):
        Trainer(cfg_or_args)


def test_bad_env_settings_are_refused_before_the_first_step(ask_dir, tmp_path, tiny_model_dir, monkeypatch):
    out = tmp_path / "run"
    _refused(_cfg(ask_dir, out, "env.name=''", "env.fn=no_such_module_xyz:make"), "env.fn.*cannot import")
    monkeypatch.setattr("hybrid_rl.envs.tiny_ask.make_nothing", lambda row: object(), raising=False)
    _refused(
        _cfg(ask_dir, out, "env.name=''", "env.fn=hybrid_rl.envs.tiny_ask:make_nothing"),
        "without reset and step",
        EnvError,
    )
    _refused(_cfg(ask_dir, out, f"model.path={tiny_model_dir}"), "no chat template", ValueError)
    _refused(_cfg(ask_dir, out, "rollout.max_episode_tokens=3"), "rollout.max_episode_tokens.*3-token")
    _refused(_cfg(ask_dir, out, "rollout.max_episode_tokens=4096"), "rollout.max_episode_tokens.*context")
    with pytest.raises(ValueError, match="reward.weights"):
        load_config(None, ["reward.weights.env=1.0"])
    with pytest.raises(ValueError, match="env.timeout_s"):
        _cfg(ask_dir, out, "env.timeout_s=0")
    assert not os.path.exists(out / "metrics.jsonl")


def test_validation_runs_episodes(ask_dir, tmp_path, monkeypatch):
    import hybrid_rl.envs.episodes as episodes_mod

    calls = []
    run = episodes_mod.EpisodeRunner.run
    monkeypatch.setattr(
        episodes_mod.EpisodeRunner,
        "run",
        lambda self, rows, G, params: calls.append((len(rows), G, params.greedy)) or run(self, rows, G, params),
    )
    trainer = Trainer(_cfg(ask_dir, tmp_path, "data.val_split=0.25", "trainer.val_n=2"))
    metrics = trainer.validator.run(0)
    assert calls and all(G in (1, 2) for _, G, _ in calls) and any(g for _, _, g in calls)
    assert {"val/pass@1", "val/reward_mean", "val/mean@2"} <= set(metrics)
    assert metrics["val/response_length"] >= 1


def test_resume_mid_run_is_bit_exact(ask_dir, tmp_path):
    def make(out, steps, *more):
        return Trainer(_cfg(ask_dir, out, f"trainer.total_steps={steps}", *more))

    straight = make(tmp_path / "a", 4)
    full = straight.fit()
    first = make(tmp_path / "b", 2, "trainer.save_every=2")
    first.fit()
    first.close()
    second = make(tmp_path / "b", 4)
    assert second.step_idx == 2
    rest = second.fit()
    clean = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "switch/")) and k != "bottleneck"}
    assert [clean(m) for m in full[2:]] == [clean(m) for m in rest]
    for (n, a), (_, b) in zip(straight.policy.named_parameters(), second.policy.named_parameters()):
        assert torch.equal(a, b), n


def test_ppo_over_episodes_skips_the_observation_holes(ask_dir, tmp_path, monkeypatch):
    """PPO with a critic (issue 36) on two-turn episodes: with gamma = lam = 1 and no KL, GAE's return on every
    generated token is the episode's outcome, so each row's returns are one constant over its generated tokens and
    0 on its observation holes and padding; the critic trains on that batch. Catches: holes that take a reward or a
    return, values bootstrapped across turns as if the observation were generated."""
    import hybrid_rl.trainer as trainer_mod

    seen = []
    real = trainer_mod.critic_update

    def spy(**kw):
        seen.append(kw["batch"])
        return real(**kw)

    monkeypatch.setattr(trainer_mod, "critic_update", spy)
    trainer = Trainer(_cfg(ask_dir, tmp_path, "algorithm.advantage=gae", "data.batch_size=8"))
    metrics = [trainer.step(), trainer.step()][-1]
    trainer.close()
    holes = 0
    for batch in seen:
        mask, ret = batch.mask_NT, batch.returns_NT
        for r in range(len(batch)):
            on = ret[r][mask[r] != 0]
            assert on.numel() > 0 and torch.allclose(on, on[0].expand_as(on), atol=1e-6), (r, on)
            assert torch.all(ret[r][mask[r] == 0] == 0)
            gen = (mask[r] != 0).nonzero().flatten()
            holes += int(gen[-1] - gen[0] + 1 - gen.numel())  # observation tokens between the first and last turn
    assert holes > 0, "the episodes must hold observation tokens between their turns"
    assert "critic/vf_loss" in metrics


def test_a_steps_engine_account_covers_every_turn(ask_dir, tmp_path):
    """rollout/tokens_generated and time/rollout_tail add up every engine call of the step (an episode's turns), not
    the last one. Oracle: the engine's own outputs and per-call tails, recorded at each call. Catches: the metrics
    read from the engine after the step, which keeps only its last call's account."""
    tr = Trainer(_cfg(ask_dir, tmp_path, "trainer.total_steps=4"))
    calls, inner = [], tr.engine.generate

    def recorded(*args, **kwargs):
        out = inner(*args, **kwargs)
        calls.append((sum(len(c.token_ids) for c in out), tr.engine.last_tail_s))
        return out

    tr.engine.generate = recorded
    turns = 0
    for _ in range(4):
        calls.clear()
        metrics = tr.step()
        assert metrics["rollout/tokens_generated"] == sum(n for n, _ in calls)
        assert metrics["time/rollout_tail"] == pytest.approx(sum(t for _, t in calls))
        turns = max(turns, len(calls))
    tr.close()
    assert turns >= 2, "no step took two turns: the test would not see the last call read alone"
