"""What the run directory's config.yaml records about the reward (loop/reward_setup.py `RewardSetup.recorded`): the
reward that ran, not a `reward.name` that `reward.fn` or a Python function replaced.

Catches: config.yaml showing `reward.name: digits` for a run scored by `reward.fn` or `Trainer(reward_fn=...)`,
a record that no longer loads, and the recorded config leaking into what resume compares (the checkpoint's).
"""

from __future__ import annotations

import os

from hybrid_rl.config.load import load_config
from hybrid_rl.loop.reward_setup import RewardSetup


def my_reward(prompts, completions, metadata):
    return [0.0] * len(completions)


def _recorded(extra=(), reward_fn=None):
    cfg = load_config(None, list(extra))
    used, line = RewardSetup.resolve(cfg, reward_fn).recorded(cfg)
    return cfg, used, line


def test_each_way_of_naming_the_reward_is_recorded_as_what_ran():
    cfg, used, line = _recorded()
    assert line == "reward used: rule x 1 = reward.name=digits" and used == cfg

    cfg, used, line = _recorded([f"reward.fn={__name__}:my_reward"])
    assert line == f"reward used: rule x 1 = reward.fn={__name__}:my_reward"
    assert used.reward.name == "" and used.reward.fn == cfg.reward.fn and cfg.reward.name == "digits"

    cfg, used, line = _recorded(reward_fn=my_reward)
    assert line == (
        f"reward used: rule x 1 = {__name__}:my_reward (a Python function passed as Trainer(cfg, reward_fn=...))"
    )
    assert (used.reward.name, used.reward.fn) == ("", f"{__name__}:my_reward") and cfg.reward.fn == ""

    _, _, line = _recorded(["reward.weights.rule=0.5", "env.name=tiny_ask", "reward.weights.env=1.0"])
    assert (
        line == "reward used: rule x 0.5 = reward.name=digits; env x 1 = the summed step rewards of env.name=tiny_ask"
    )
    _, _, line = _recorded(["env.name=tiny_ask"])
    assert line.endswith("(no rule reward: reward.name and reward.fn below were not used)")


def test_config_yaml_says_it_and_still_loads(tiny_trainer_overrides):
    from hybrid_rl import Trainer

    tr = Trainer(load_config(None, tiny_trainer_overrides), reward_fn=my_reward)
    path = os.path.join(tr.out_dir, "config.yaml")
    with open(path) as f:
        first = f.readline()
    assert (
        first
        == f"# reward used: rule x 1 = {__name__}:my_reward (a Python function passed as Trainer(cfg, reward_fn=...))\n"
    )
    again = load_config(path)
    assert again.reward.fn == f"{__name__}:my_reward" and again.reward.name == ""
    assert tr.cfg.reward.name == "digits"  # the run's own config (what a checkpoint records) is unchanged
