"""Config checks that need a Trainer or a rank count (hybrid_rl/config/schema.py): samples per prompt,
mini-batch units, batches over ranks, the form of reward.fn, and a config changed after loading.
Each fails at `Trainer(cfg)` (or `validate_runtime`) with an error naming the key, before a
training step. (Schema, merging and per-key value checks are in test_config.py.)
"""

from __future__ import annotations

import os

import pytest

from hybrid_rl.config.load import load_config
from hybrid_rl.loop.preflight import validate_runtime
from hybrid_rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _trainer(overrides, *extra):
    return Trainer(load_config(None, [*overrides, *extra]))


def test_good_input_builds_a_trainer(tiny_trainer_overrides, tmp_path):
    """The control for every bad-input test (here and in test_data.py, test_rewards.py,
    test_model_loading.py): the tiny overrides build, so each refusal comes from its one bad key.

    Catches: the tokenizer's EOS / pad ids, the saved config.yaml or the loader's batch size lost
    while the Trainer is built."""
    tr = _trainer(tiny_trainer_overrides)
    assert tr.tokenizer.eos_token_id == 1 and tr.tokenizer.pad_token_id == 0
    assert os.path.isfile(os.path.join(tr.out_dir, "config.yaml"))
    assert tr.state.loader.batch_size == 4


# ---------------------------------------------------------------------------- group size, ranks
def test_fewer_than_two_samples_per_prompt(tiny_trainer_overrides):
    """A group baseline needs two samples; REINFORCE++ whitens over the batch and runs with one (verl's usual
    setting for it), unless dynamic sampling needs groups.

    Catches: rollout.n=1 accepted for a group baseline (every advantage 0, nothing trains), or
    refused for REINFORCE++ as well, or accepted with dynamic sampling."""
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "rollout.n=1")
    assert "'rollout.n'" in str(err.value) and "at least 2" in str(err.value) and "group" in str(err.value)
    with pytest.raises(ValueError, match="'rollout.n'.*dynamic sampling"):
        _trainer(
            tiny_trainer_overrides, "rollout.n=1", "algorithm.advantage=reinforce_pp", "algorithm.dynamic_sampling=true"
        )
    m = _trainer(tiny_trainer_overrides, "rollout.n=1", "algorithm.advantage=reinforce_pp", "data.batch_size=8").step()
    assert m["actor/grad_norm"] > 0 and m["response/length"] > 0


def test_mini_batch_counts_sequences_and_keeps_groups_whole(tiny_trainer_overrides):
    """verl's ppo_mini_batch_size counts prompts; ours counts sequences. A count that would split a
    prompt's group (a verl value typed as is, e.g. 6 with n=4) is refused and the units named.

    Catches: a mini-batch size that is not a multiple of rollout.n accepted (groups split across
    mini-batches)."""
    with pytest.raises(ValueError, match="'algorithm.mini_batch_size'.*multiple of rollout.n=4.*verl"):
        _trainer(tiny_trainer_overrides, "rollout.n=4", "data.batch_size=6", "algorithm.mini_batch_size=6")


def test_batch_not_divisible_over_ranks(tiny_model_dir):
    """Catches: validate_runtime accepting a batch that the ranks cannot split evenly."""
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.batch_size=32"])
    validate_runtime(cfg, 4)
    with pytest.raises(ValueError) as err:
        validate_runtime(cfg, 3)
    msg = str(err.value)
    assert "'data.batch_size'" in msg and "3 ranks" in msg and "multiple of 3" in msg


# ---------------------------------------------------------------------------- reward.fn, changed configs
def test_reward_fn_not_of_the_module_function_form(tiny_trainer_overrides):
    """Catches: a reward.fn without 'module:function' accepted by the config (it fails on import later,
    without naming the form)."""
    with pytest.raises(ValueError, match="'reward.fn'.*package.module:function"):
        _trainer(tiny_trainer_overrides, "reward.fn=just_a_name")


def test_a_config_changed_after_loading_is_checked_again(tiny_trainer_overrides, no_model_build):
    """In a notebook `cfg.rollout.n = 1` after load_config skipped every check: Trainer checks the config
    again (values and types) before building anything; a string override list is named for what it is.

    Catches: Trainer trusting a config object changed after load_config, or load_config iterating
    a string of overrides character by character."""
    from hybrid_rl import Trainer, load_config

    for section, key, value, match in [
        ("rollout", "n", 1, "'rollout.n'"),
        ("data", "batch_size", 0, "'data.batch_size'"),
    ]:
        cfg = load_config(None, tiny_trainer_overrides)
        setattr(getattr(cfg, section), key, value)
        with pytest.raises(ValueError, match=match):
            Trainer(cfg)
    # A wrong type is refused where it is set (test_config.py: test_fields_set_from_python_are_checked).
    with pytest.raises(ValueError, match="'optim.lr'.*could not be converted"):
        cfg.optim.lr = "fast"
    with pytest.raises(TypeError, match=r"pass \['optim.lr=1e-5'\]"):
        load_config(None, "optim.lr=1e-5")


@pytest.mark.parametrize(
    "bad, line",
    [
        (
            "trainer.total_step=3",
            "error: config key 'trainer.total_step': Key 'total_step' not in 'TrainerConfig'. "
            "Did you mean: 'total_steps'?",
        ),
        ("rollout.n=0", "error: config key 'rollout.n': must be >= 1, got 0"),
    ],
)
def test_a_recipe_prints_a_config_error_as_its_one_line(tmp_path, bad, line):
    """From the command line a config error is the one line that says what to fix, exit status 2: no traceback
    for the user to read through (recipes' __main__, config.checks.command_line). Another error keeps its
    traceback (test_first_run, test_failure_report)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "recipes", "grpo_tiny.py"), bad, f"trainer.out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-2000:]


def test_command_line_keeps_every_other_error():
    from hybrid_rl.config.checks import command_line

    def broken(argv):
        raise ValueError("a bug, not a config key")

    with pytest.raises(ValueError, match="a bug"):
        command_line(broken, [])
    assert command_line(lambda argv: None, []) == 0
