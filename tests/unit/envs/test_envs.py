"""envs/base.py and the tiny ask task: naming an environment, and the errors a broken one gets.

Every error must name the environment and, once episodes run, the episode (row, sample, turn):
with hundreds of episodes in flight, "step() returned None" alone is useless.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from hybrid_rl.envs import EnvError, Environment, Step, as_step, get_env, load_env_factory, make_env, register_env
from hybrid_rl.envs.base import resolve_env
from hybrid_rl.envs.tiny_ask import ANSWER_REWARD, ASK_REWARD, SECRET_DIGITS, AskEnv, ask_rows, build_ask_tokenizer


class _Env:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, completion):
        return Step([], 1.0, True)


def test_builtins_are_registered():
    for name in ("tiny_ask", "gsm8k_calculator"):
        env = get_env(name).factory({"prompt": "p", "secret": "3", "ground_truth": "1"})
        assert isinstance(env, Environment)


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown environment 'nope'.*'tiny_ask'"):
        get_env("nope")


def test_register_refuses_a_taken_name_but_a_rerun_cell_replaces_itself():
    def make(row):
        return _Env()

    register_env("test_envs_echo")(make)
    register_env("test_envs_echo")(make)  # the same function again: fine

    def other(row):
        return _Env()

    with pytest.raises(ValueError, match="already registered"):
        register_env("test_envs_echo")(other)


@pytest.fixture
def env_module():
    mod = types.ModuleType("user_envs_for_test")
    mod.make = lambda row: _Env()
    mod.not_callable = 3
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    del sys.modules[mod.__name__]


def test_env_fn_loads_a_factory(env_module):
    factory = load_env_factory(f"{env_module}:make")
    assert factory({"prompt": "x"}).reset({"prompt": "x"}) == [{"role": "user", "content": "x"}]
    name, spec = resolve_env(fn_path=f"{env_module}:make")
    assert name == f"{env_module}:make" and spec.factory is factory


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_colon", "not of the form"),
        ("no_such_module_xyz:make", "cannot import module"),
        ("{mod}:missing", "has no attribute"),
        ("{mod}:not_callable", "not a callable"),
    ],
)
def test_env_fn_errors_name_the_key(env_module, path, message):
    with pytest.raises(ValueError, match=message) as err:
        load_env_factory(path.format(mod=env_module))
    assert "env.fn" in str(err.value)


def test_resolve_env_wants_exactly_one_way():
    with pytest.raises(ValueError, match="named 2 ways"):
        resolve_env(name="tiny_ask", factory=lambda row: _Env())
    with pytest.raises(ValueError, match="no environment"):
        resolve_env()


def test_factory_result_without_reset_or_step_names_the_factory():
    def broken(row):
        return object()

    with pytest.raises(EnvError, match=r"'mine'.*broken returned a object without reset and step.*row 4"):
        make_env(broken, {}, "mine", "episode of row 4")


def test_factory_that_raises_names_the_episode():
    def boom(row):
        raise KeyError("prompt")

    with pytest.raises(EnvError, match=r"'mine'.*raised KeyError.*row 2"):
        make_env(boom, {}, "mine", "episode of row 2")


@dataclass
class _Duck:  # not the library's Step, but has what a step result needs
    observation: list
    reward: float
    done: bool


def test_duck_typed_step_results_are_accepted():
    step = as_step(_Duck([{"role": "tool", "content": "x"}], 2, False), "e", "ep")
    assert step == Step([{"role": "tool", "content": "x"}], 2.0, False)


@pytest.mark.parametrize(
    "result, message",
    [
        (None, "NoneType without observation, reward, done"),
        ("text", "str without"),
        (_Duck([], float("nan"), True), "finite real"),
        (_Duck([], float("inf"), True), "finite real"),
        (_Duck([], "1", True), "finite real"),
        (_Duck("hello", 0.0, False), "list of chat messages"),
        (_Duck([{"role": "tool"}], 0.0, False), r"observation\[0\] must be a dict"),
        (_Duck([], 0.0, "yes"), "done must be a bool"),
    ],
)
def test_wrong_step_results_name_environment_and_episode(result, message):
    with pytest.raises(EnvError, match=message) as err:
        as_step(result, "my_env", "episode of row 7 (sample 1), turn 2")
    assert "'my_env'" in str(err.value) and "row 7 (sample 1), turn 2" in str(err.value)


@pytest.mark.parametrize(
    "turns, rewards",
    [
        (["ask", "7"], [0.0, 1.0]),
        (["ask 3", "7 2"], [0.0, 1.0]),
        (["ask3", "72"], [0.0, 1.0]),  # spaces or none
        (["ask", "3"], [0.0, ASK_REWARD]),  # asked and answered, wrongly
        (["ask", "ask"], [0.0, 0.0]),  # asked twice: no answer
        (["7"], [0.0]),  # the right digit without asking: nothing, and over
        (["<eos>"], [0.0]),
    ],
)
def test_tiny_ask_needs_two_turns_for_full_reward(turns, rewards):
    row = {"prompt": "?", "secret": "7"}
    env = AskEnv(row)
    assert env.reset(row) == [{"role": "user", "content": "?"}]
    steps = [env.step(t) for t in turns]
    assert [s.reward for s in steps] == rewards and steps[-1].done and not any(s.done for s in steps[:-1])
    if len(turns) == 2:
        assert steps[0].observation == [{"role": "tool", "content": "7"}]
    assert ASK_REWARD + ANSWER_REWARD == 1.0


def test_tiny_ask_tokenizer_survives_loading(tmp_path):
    """transformers loads the saved directory as a byte-level Qwen2Tokenizer; the ids must not change."""
    from hybrid_rl.envs.tiny_ask import build_ask_model_dir
    from hybrid_rl.models.loading import load_tokenizer

    conversation = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "ask"},
        {"role": "tool", "content": "7"},
    ]
    built, loaded = build_ask_tokenizer(), load_tokenizer(build_ask_model_dir(str(tmp_path / "ask"), hidden_size=16))
    ids = [t.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False) for t in (built, loaded)]
    ids = [t(text, add_special_tokens=False).input_ids for t, text in zip((built, loaded), ids)]
    assert ids[0] == ids[1] and built.convert_ids_to_tokens(ids[0]) == [
        "<user>",
        "?",
        "<assistant>",
        "ask",
        "<eos>",
        "<tool>",
        "7",
        "<assistant>",
    ]


def test_tiny_ask_rows_and_vocabulary():
    rows = ask_rows(50, seed=0)
    assert rows == ask_rows(50, seed=0) and len({r["secret"] for r in rows}) == SECRET_DIGITS == 4
    assert len({r["secret"] for r in ask_rows(100, seed=0, digits=10)}) == 10
    tok = build_ask_tokenizer()
    assert len(tok) <= 24 and tok.chat_template  # small enough for the tiny model to learn over
    assert "<unk>" not in tok.convert_ids_to_tokens(tok("<user> ? <assistant> ask <eos> <tool> 7").input_ids)
