"""The trainer's parts a second loop reuses, tested without a training step: the run state
(hybrid_rl/loop/run_state.py), the layout of a checkpoint's rank file (checkpoints written before the
run state existed must still load), and the one definition of what a reward sees
(`RewardSetup.rule_rewards`, used by the training step, validation and the start-up probe)."""

from __future__ import annotations

import os

import pytest
import torch

from hybrid_rl.algorithms.kl import AdaptiveKLController
from hybrid_rl.config.load import load_config
from hybrid_rl.data.prompts import PromptLoader
from hybrid_rl.loop.reward_setup import RewardSetup
from hybrid_rl.loop.run_state import RunState
from hybrid_rl.rewards.combine import RunningNorm
from hybrid_rl.types import Completion

# What a rank file holds. Issue 26 renamed two keys (the phase switch counts rollouts, not steps):
# files written before it hold "switch_step" and "ledger_step" instead, and still load.
# "partial": rollout.partial's carried samples (issue 37), None when off; checkpoints without it still resume.
RANK_FILE_KEYS = {
    "step",
    "loader",
    "scheduler",
    "kl_coef",
    "switch_rollouts",
    "ledger_rollout",
    "reward_norm",
    "rng",
    "partial",
}


def _state(norm: bool) -> RunState:
    rows = [{"prompt": f"p{i}"} for i in range(10)]
    return RunState(
        loader=PromptLoader(rows, 4, seed=3),
        kl_ctl=AdaptiveKLController(0.1, 0.01, 100),
        reward_norm=RunningNorm() if norm else None,
    )


def test_run_state_round_trip_continues_the_same_run():
    """Catches a field that state_dict drops or load_state_dict does not restore (loader position, KL
    coefficient, normaliser, step counters): the restored state would draw other batches or scale otherwise."""
    a = _state(norm=True)
    for _ in range(3):
        a.loader.next_batch()
    a.kl_ctl.update(0.5, 8)
    a.reward_norm.update(torch.tensor([1.0, 2.0, 4.0]))
    a.step, a.ledger_rollout = 3, 7
    a.history.append({"step": 3})
    b = _state(norm=True)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert (b.step, b.ledger_rollout, b.kl_ctl.value) == (3, 7, a.kl_ctl.value) and b.kl_ctl.value != 0.1
    assert b.loader.next_batch() == a.loader.next_batch()
    assert b.history == [], "the history is this process's, not saved"


@pytest.mark.parametrize("saved_norm", [True, False])
def test_run_state_refuses_a_normaliser_switched_on_or_off(saved_norm):
    with pytest.raises(
        ValueError,
        match=f"reward normaliser {'on' if saved_norm else 'off'}; this run has it {'off' if saved_norm else 'on'}",
    ):
        _state(norm=not saved_norm).load_state_dict(_state(norm=saved_norm).state_dict())


def test_rank_file_keeps_the_layout_of_earlier_checkpoints(tiny_trainer_overrides):
    """Catches a rename or a dropped key in what a rank file holds: checkpoints written before would no
    longer load (or would load without the phase switch's counters)."""
    from hybrid_rl.trainer import Trainer

    tr = Trainer(load_config(None, tiny_trainer_overrides))
    path = tr.save_checkpoint()
    saved = torch.load(os.path.join(path, "rank_00000.pt"), weights_only=True)
    assert set(saved) == RANK_FILE_KEYS
    assert saved["switch_rollouts"] == tr.phases.rollouts and saved["scheduler"] == tr.scheduler.state_dict()
    tr.close()


def test_a_rank_file_with_the_old_counter_names_still_loads(tiny_trainer_overrides):
    """Catches dropping the fallback to "switch_step" / "ledger_step": a checkpoint written before issue 26
    renamed them would stop loading (KeyError), or load without the phase switch's rollout count."""
    from hybrid_rl.trainer import Trainer

    tr = Trainer(load_config(None, tiny_trainer_overrides))
    tr.phases.rollouts, tr.state.ledger_rollout = 5, 4
    path = tr.save_checkpoint()
    tr.close()
    rank_file = os.path.join(path, "rank_00000.pt")
    saved = torch.load(rank_file, weights_only=True)
    saved["switch_step"], saved["ledger_step"] = saved.pop("switch_rollouts"), saved.pop("ledger_rollout")
    torch.save(saved, rank_file)
    from hybrid_rl.checkpoint import manifest

    manifest.write(path, manifest.describe(path, manifest.listing(path)))  # as that old save wrote it
    fresh = Trainer(load_config(None, tiny_trainer_overrides))
    fresh.checkpointer.restore(path)
    assert (fresh.phases.rollouts, fresh.state.ledger_rollout) == (5, 4)
    fresh.close()


def test_the_probe_validation_and_training_see_the_same_reward_inputs(tiny_trainer_overrides, tiny_tokenizer):
    """What a reward function receives comes from one place: the prompt of completion i's row (rows[i // G]),
    the text without its stop token, and metadata = the row + finish_reason + response_tokens. Catches a
    caller that pairs completions with rows[i % B] or counts the stop token."""
    seen = []

    def spy(prompts, completions, metadata):
        seen.append((list(prompts), list(completions), [dict(m) for m in metadata]))
        return [1.0] * len(completions)

    setup = RewardSetup.resolve(load_config(None, tiny_trainer_overrides), spy)
    eos = tiny_tokenizer.eos_token_id
    one = [t for t in range(tiny_tokenizer.vocab_size) if t not in tiny_tokenizer.all_special_ids][:2]
    rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]
    done, cut = Completion(one + [eos], [0.0] * (len(one) + 1), "stop"), Completion(one, [0.0] * len(one), "length")
    texts, rewards = setup.rule_rewards(rows, [done, cut, cut, done], 2, tiny_tokenizer, {eos})
    assert rewards == [1.0] * 4 and texts == [tiny_tokenizer.decode(one, skip_special_tokens=True)] * 4 and texts[0]
    prompts, _, meta = seen[-1]
    assert prompts == ["a", "a", "b", "b"]
    assert [m["answer"] for m in meta] == [1, 1, 2, 2]
    assert [(m["finish_reason"], m["response_tokens"]) for m in meta] == [
        ("stop", 2),
        ("length", 2),
        ("length", 2),
        ("stop", 2),
    ]
    reward_N, score_N, logged = setup.score(rows, [done, cut, cut, done], 2, tiny_tokenizer, {eos})
    assert seen[-1] == (prompts, texts, meta) and reward_N.tolist() == [1.0] * 4 and logged == {}
    setup.probe(rows, tiny_tokenizer)
    assert seen[-1] == (["a", "b"], ["", ""], [{**r, "finish_reason": "length", "response_tokens": 0} for r in rows])
