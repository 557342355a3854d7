"""Reward functions as the trainer uses them (hybrid_rl/loop/reward_setup.py and base.py): the start-up
probe that runs the reward once before the first step, `reward.fn` imports and `reward.kwargs`, the
numbers a reward may return, and which dataset row each completion is scored against.

Bad rewards fail at `Trainer(cfg)` with an error that names the reward and what to fix; where the
check runs before the model is loaded, `no_model_build` (tests/conftest.py) pins that too.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_rl.config.load import load_config
from hybrid_rl.rewards.base import register_reward
from hybrid_rl.trainer import Trainer
from hybrid_rl.types import Completion

pytestmark = pytest.mark.usefixtures("torch_one_thread")


# ---------------------------------------------------------------------------- test rewards
def _register(name, fn):
    try:
        register_reward(name)(fn)
    except ValueError:  # already registered (module imported twice)
        pass
    return name


def _raises(prompts, completions, metadata):
    raise KeyError("solution")


def _nan(prompts, completions, metadata):
    return [0.0] + [math.nan] * (len(completions) - 1)


def _inf(prompts, completions, metadata):
    return [math.inf for _ in completions]


def _short(prompts, completions, metadata):
    return [0.0]


def _not_a_number(prompts, completions, metadata):
    return ["1.0" for _ in completions]


R_RAISES = _register("test_rewards.raises", _raises)
R_NAN = _register("test_rewards.nan", _nan)
R_INF = _register("test_rewards.inf", _inf)
R_SHORT = _register("test_rewards.short", _short)
R_STR = _register("test_rewards.str", _not_a_number)


def _two_args(prompts, completions):  # a reward function with the wrong signature (for reward.fn)
    return [0.0 for _ in completions]


NOT_A_FUNCTION = [1.0]


def _trainer(overrides, *extra):
    return Trainer(load_config(None, [*overrides, *extra]))


# ---------------------------------------------------------------------------- registered rewards (reward.name)
def test_reward_that_raises(tiny_trainer_overrides, no_model_build):
    """Catches: the start-up probe dropped (the reward's KeyError would come at the first step), or its
    error losing the reward's name or the original exception as its cause."""
    with pytest.raises(RuntimeError) as err:
        _trainer(tiny_trainer_overrides, f"reward.name={R_RAISES}")
    msg = str(err.value)
    assert R_RAISES in msg and "KeyError" in msg and "solution" in msg
    assert isinstance(err.value.__cause__, KeyError)


@pytest.mark.parametrize("name,bad", [(R_NAN, "nan"), (R_INF, "inf"), (R_STR, "'1.0'")])
def test_reward_returning_non_finite_or_non_float(tiny_trainer_overrides, no_model_build, name, bad):
    """Catches: a nan, inf or string reward accepted (it would make the advantages and the loss nan)."""
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, f"reward.name={name}")
    msg = str(err.value)
    assert name in msg and bad in msg and "finite" in msg


def test_reward_returning_wrong_count(tiny_trainer_overrides, no_model_build):
    """Catches: a reward returning fewer values than completions accepted (the scores would no longer
    line up with the completions)."""
    with pytest.raises(ValueError, match=rf"{R_SHORT}.*returned 1 rewards for 2 completions"):
        _trainer(tiny_trainer_overrides, f"reward.name={R_SHORT}")


def test_unknown_reward_name(tiny_trainer_overrides, no_model_build):
    """Catches: an unknown reward.name reported without the key or without the names registered."""
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "reward.name=no_such_reward")
    msg = str(err.value)
    assert "no_such_reward" in msg and "'reward.name'" in msg and "digits" in msg  # lists what is registered


def test_a_builtin_reward_on_another_builtin_task_warns(tiny_trainer_overrides):
    """Catches: the digits task trained with the gsm8k reward without a word (every reward 0)."""
    with pytest.warns(UserWarning, match=r"reward.name=gsm8k is the reward of data.task=gsm8k.*data.task=digits"):
        _trainer(tiny_trainer_overrides, "reward.name=gsm8k")


# ---------------------------------------------------------------------------- reward functions by import / argument
@pytest.mark.parametrize(
    "fn,words",
    [
        ("no_such_module_xyz:score", ["'reward.fn'", "cannot import module 'no_such_module_xyz'"]),
        ("hybrid_rl.rewards.toy:no_such_fn", ["'reward.fn'", "has no attribute 'no_such_fn'"]),
        ("tests.unit.rewards.test_rewards:NOT_A_FUNCTION", ["not a callable"]),
        (
            "tests.unit.rewards.test_rewards:_two_args",
            ["cannot be called as fn(prompts, completions, metadata)", "_two_args(prompts, completions)"],
        ),
    ],
)
def test_reward_fn_that_cannot_be_used(tiny_trainer_overrides, no_model_build, fn, words):
    """Catches: reward.fn imported without checking that the module and attribute exist and that it
    is a callable taking (prompts, completions, metadata): the first step would fail instead."""
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, f"reward.fn={fn}")
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_reward_kwargs_the_function_does_not_take(tiny_trainer_overrides, no_model_build):
    """Catches: reward.kwargs not checked against the function's parameters (a TypeError at the first step)."""
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "reward.name=digits", "reward.kwargs.mode=strict")
    assert "reward.kwargs" in str(err.value) and "mode" in str(err.value)


def test_reward_fn_argument_and_config_key_together(tiny_trainer_overrides, no_model_build):
    """Catches: one of Trainer(reward_fn=...) and reward.fn silently winning over the other."""
    with pytest.raises(ValueError, match="'reward.fn'.*give one of them"):
        Trainer(
            load_config(None, [*tiny_trainer_overrides, "reward.fn=hybrid_rl.rewards.toy:digits_reward"]),
            reward_fn=_nan,
        )


def test_reward_fn_that_raises_names_the_sample(tiny_trainer_overrides, no_model_build):
    """Catches: a user function's exception reported without the sample it failed on (completion
    index and prompt) or the function's name."""
    from hybrid_rl.data.digits import digits_rows

    second = digits_rows(4096, 0)[1]["prompt"]

    def picky(prompts, completions, metadata):
        return [1.0 / (m["prompt"] != second) for m in metadata]  # ZeroDivisionError on the probe's 2nd sample

    with pytest.raises(RuntimeError) as err:
        Trainer(load_config(None, tiny_trainer_overrides), reward_fn=picky)
    msg = str(err.value)
    assert "ZeroDivisionError" in msg and "completion 1" in msg and repr(second) in msg and "picky" in msg


def test_reward_fn_returning_nan_names_the_sample(tiny_trainer_overrides, no_model_build):
    """Catches: a non-finite reward from a reward_fn reported without the completion and prompt it scored."""
    with pytest.raises(ValueError) as err:
        Trainer(load_config(None, tiny_trainer_overrides), reward_fn=_nan)
    msg = str(err.value)
    assert "nan" in msg and "completion 1" in msg and "of prompt" in msg and "finite" in msg


# ---------------------------------------------------------------------------- the numbers a reward returns
def test_reward_numbers_from_numpy_and_torch_are_accepted():
    """np.float32(1.0) or a 0-d tensor is a real number: accepted as its float; a string, a list or a
    many-element tensor is not a reward, and a non-finite numpy value is still refused.

    Catches: compute_rewards accepting Python floats only (or passing NumPy / torch scalars on
    unconverted), or accepting any of the non-numbers and non-finite values listed."""
    import numpy as np

    from hybrid_rl.rewards.base import RewardSpec, compute_rewards

    def run(values):
        return compute_rewards(
            "r", RewardSpec(lambda p, c, m: values), ["p"] * len(values), ["c"] * len(values), [{}] * len(values)
        )

    got = run([np.float32(0.5), np.int64(1), torch.tensor(0.25), np.array(2.0), torch.tensor([0.75]), True, 3])
    assert got == [0.5, 1.0, 0.25, 2.0, 0.75, 1.0, 3.0] and all(type(v) is float for v in got)
    for bad in ("1.0", [1.0], torch.tensor([1.0, 2.0]), np.float32("nan"), torch.tensor(float("inf")), None, 1j):
        with pytest.raises(ValueError, match="finite real numbers"):
            run([0.0, bad])


# ---------------------------------------------------------------------------- scoring a step's completions
def test_reward_scores_each_completion_against_its_own_row(tiny_trainer_overrides, tiny_tokenizer):
    """Catches the trainer's reward (RolloutStage.score -> RewardSetup.score) pairing completions with the wrong
    dataset row (rows[i % B] instead of rows[i // G]) and counting the stop token as part of the answer (which
    makes the digits reward's "stopped right after the answer" bonus unreachable)."""
    tr = _trainer(tiny_trainer_overrides)  # rollout.n = 2
    rows = [{"prompt": "1 2 3 =", "answer": "234"}, {"prompt": "7 8 9 =", "answer": "890"}]

    def completion(text: str, stop: bool) -> Completion:
        ids = tiny_tokenizer(" ".join(text), add_special_tokens=False).input_ids
        ids = ids + [tiny_tokenizer.eos_token_id] if stop else ids
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop" if stop else "length")

    completions = [completion("234", True), completion("230", False), completion("890", True), completion("8", True)]
    rewards, scores, _ = tr.rollout_stage.score(rows, completions, model_phase=tr.phases.reward)
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.6, 1.0, 0.3]))
    torch.testing.assert_close(scores, rewards)
