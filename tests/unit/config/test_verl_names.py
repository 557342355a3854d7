"""verl's key names accepted beside the schema's (config/load.py VERL_NAMES): issue 36 names
`algorithm.adv_estimator=gae`; the loaded config holds the schema's key, and two different values are refused."""

from __future__ import annotations

import pytest

from hybrid_rl import load_config


def test_adv_estimator_sets_the_advantage_from_an_override_and_a_yaml(tmp_path):
    assert load_config(None, ["algorithm.adv_estimator=gae"]).algorithm.advantage == "gae"
    path = tmp_path / "ppo.yaml"
    path.write_text("algorithm:\n  adv_estimator: rloo\n")
    assert load_config(str(path)).algorithm.advantage == "rloo"
    # An override in verl's name beats the YAML's key in ours, as any later layer does.
    path.write_text("algorithm:\n  advantage: grpo\n")
    assert load_config(str(path), ["algorithm.adv_estimator=gae"]).algorithm.advantage == "gae"


def test_both_names_with_different_values_are_refused():
    with pytest.raises(ValueError, match="algorithm.adv_estimator.*beside algorithm.advantage='grpo'"):
        load_config(None, ["algorithm.adv_estimator=gae", "algorithm.advantage=grpo"])
    assert load_config(None, ["algorithm.adv_estimator=gae", "algorithm.advantage=gae"]).algorithm.advantage == "gae"


def test_an_unknown_estimator_is_refused_under_the_schemas_key():
    with pytest.raises(ValueError, match="algorithm.advantage.*expected one of"):
        load_config(None, ["algorithm.adv_estimator=nope"])
