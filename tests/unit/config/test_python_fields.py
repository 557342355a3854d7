"""Config fields set from Python (config/checks.py strict_sections): a name that is not a field and a value of the
wrong type are refused where they are set, in the words the command line uses for the same mistake.

Catches: `cfg.trainer.save_evry = 1` accepted (the run silently writes no checkpoints), a string or a float
quietly converted into an integer field, a Python message that differs from the command line's, and the check
breaking what copies a config (deepcopy, pickle, the Trainer's `load_config(base=cfg)`).
"""

from __future__ import annotations

import copy
import pathlib
import pickle

import pytest

from hybrid_rl.config.load import load_config
from hybrid_rl.config.schema import LoraSettings, TrainerConfig

# (override on the command line, section path, field, the same mistake from Python)
SAME_MISTAKES = [
    ("trainer.save_evry=1", "trainer", "save_evry", 1),
    ("trainer.total_step=3", "trainer", "total_step", 3),
    ("model.lora.rnk=8", "model.lora", "rnk", 8),
    ("optim.lr=fast", "optim", "lr", "fast"),
    ("trainer.total_steps=1.5", "trainer", "total_steps", 1.5),
    ("trainer.total_steps=true", "trainer", "total_steps", True),
    ("trainer.packing=maybe", "trainer", "packing", "maybe"),
    ("model.dtype=fp8", "model", "dtype", "fp8"),
    ("trainer.loggers=[console,bogus]", "trainer", "loggers", ["console", "bogus"]),
    ("optim.betas=[a,b]", "optim", "betas", ["a", "b"]),
    ("reward.weights.rule=x", "reward", "weights", {"rule": "x"}),
    ("data.num_prompts=x", "data", "num_prompts", "x"),
]


def _message(fn) -> str:
    with pytest.raises(ValueError) as err:
        fn()
    return str(err.value)


@pytest.mark.parametrize("override, section, field, value", SAME_MISTAKES, ids=[m[0] for m in SAME_MISTAKES])
def test_python_refuses_what_the_command_line_refuses_in_the_same_words(override, section, field, value):
    command_line = _message(lambda: load_config(None, [override]))
    cfg = load_config(None, [])
    target = cfg
    for part in section.split("."):
        target = getattr(target, part)
    python = _message(lambda: setattr(target, field, value))
    assert python == command_line
    assert python.startswith(f"config key '{section}.{field}")


def test_a_misspelled_field_is_named_with_the_fields_it_may_mean():
    cfg = load_config(None, [])
    with pytest.raises(AttributeError, match=r"config key 'trainer\.save_evry'.*Did you mean one of: 'save_every'"):
        cfg.trainer.save_evry = 1
    assert not hasattr(cfg.trainer, "save_evry")
    with pytest.raises(
        ValueError, match=r"config key 'traner': Key 'traner' not in 'Config'\. Did you mean: 'trainer'"
    ):
        cfg.traner = None
    with pytest.raises(ValueError, match="config key 'trainer.checkpoint_root'"):
        cfg.trainer.checkpoint_root = "x"  # a property, read-only: not a field either


def test_constructors_and_whole_sections_are_checked_too():
    with pytest.raises(ValueError, match=r"config key 'trainer\.total_steps': Value '5' of type 'str'"):
        TrainerConfig(total_steps="5")
    with pytest.raises(ValueError, match=r"config key 'model\.lora': Value '3' of type 'int' is not a LoraSettings"):
        load_config(None, []).model.lora = 3
    with pytest.raises(ValueError, match=r"config key 'trainer\.loggers': .*is not a list.*\['console'\]"):
        load_config(None, []).trainer.loggers = "console"


def test_lossless_widenings_are_kept_and_copies_still_work(tmp_path):
    cfg = load_config(None, [])
    cfg.optim.lr = 1
    cfg.model.path = pathlib.Path(tmp_path)
    cfg.algorithm.clip_ratio_low = None
    cfg.model.lora = LoraSettings(rank=4)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.model.path == str(tmp_path) and isinstance(cfg.model.path, str)
    again = load_config(base=cfg)  # what Trainer(cfg) does
    assert again == cfg == copy.deepcopy(cfg) == pickle.loads(pickle.dumps(cfg))
    again.trainer.total_steps = 7
    assert again.trainer.total_steps == 7 and cfg.trainer.total_steps != 7
