"""Algorithm presets and the algorithm config keys: selection, layering, validation.

Layering rule under test: `algorithm.preset=NAME` expands to the preset's keys in the
layer that names it (YAML or command line); keys written in that layer or a later one win.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from hybrid_rl.algorithms.correction import CORRECTION_MODES
from hybrid_rl.algorithms.losses import POLICY_LOSSES
from hybrid_rl.algorithms.presets import LOSS_CLIP_DEFAULTS, PRESETS, preset_values
from hybrid_rl.config.load import load_config, save_config
from hybrid_rl.config.schema import AlgorithmConfig

FIELDS = {f.name for f in dataclasses.fields(AlgorithmConfig)}
EXPECTED = {  # the published settings, restated independently of presets.py
    "grpo": dict(
        advantage="grpo",
        policy_loss="ppo_clip",
        loss_agg="seq-mean-token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        kl_placement="loss",
        kl_coef=0.04,
        kl_estimator="k3",
        dynamic_sampling=False,
    ),
    "drgrpo": dict(
        advantage="drgrpo",
        policy_loss="ppo_clip",
        loss_agg="seq-mean-token-sum-norm",
        kl_coef=0.0,
        dynamic_sampling=False,
        overlong_filter=False,
    ),
    "dapo": dict(
        advantage="grpo",
        policy_loss="ppo_clip",
        loss_agg="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        kl_coef=0.0,
        dynamic_sampling=True,
        overlong_filter=True,
        overlong_penalty_factor=1.0,
    ),
    "gspo": dict(
        advantage="grpo",
        policy_loss="gspo",
        loss_agg="seq-mean-token-mean",
        clip_ratio_low=3e-4,
        clip_ratio_high=4e-4,
        kl_coef=0.0,
        dynamic_sampling=False,
    ),
}


def test_every_preset_is_tested_and_cites_its_paper():
    assert set(PRESETS) == set(EXPECTED)
    for name, fn in PRESETS.items():
        assert re.search(r"arXiv:\d{4}\.\d{5}", fn.__doc__ or ""), f"preset {name} must cite its paper"
        assert set(fn()) <= FIELDS, f"preset {name} sets unknown keys {set(fn()) - FIELDS}"
        assert fn() is not fn() and preset_values(name) == fn()  # fresh dicts: callers may mutate


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_selected_from_the_command_line(name):
    algo = load_config(None, [f"algorithm.preset={name}"]).algorithm
    assert algo.preset == name
    for key, value in EXPECTED[name].items():
        assert getattr(algo, key) == pytest.approx(value), key
    assert algo.clip_bounds() == (algo.clip_ratio_low, algo.clip_ratio_high)
    assert algo.needs_ref_model == (name == "grpo")
    assert algo == AlgorithmConfig.from_preset(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cli_preset_beats_the_yaml_algorithm_keys(tmp_path, name):
    # The recipe's YAML sets token-mean and kl_coef 0.001; naming a preset later must give the method, not a mix.
    path = tmp_path / "c.yaml"
    path.write_text(
        "algorithm:\n  loss_agg: seq-mean-token-sum\n  kl_coef: 0.001\n  advantage: rloo\n  ppo_epochs: 2\n"
    )
    algo = load_config(str(path), [f"algorithm.preset={name}"]).algorithm
    for key, value in EXPECTED[name].items():
        assert getattr(algo, key) == pytest.approx(value), key
    assert algo.ppo_epochs == 2, "keys a preset does not set keep their YAML value"


def test_explicit_keys_beat_the_preset(tmp_path):
    algo = load_config(
        None, ["algorithm.preset=dapo", "algorithm.clip_ratio_high=0.3", "algorithm.dynamic_sampling=false"]
    ).algorithm
    assert algo.clip_ratio_high == 0.3 and algo.dynamic_sampling is False  # false equals the schema default: still wins
    assert algo.loss_agg == "token-mean" and algo.overlong_filter is True
    # Preset in the YAML, key in the same YAML: the key wins; a later CLI key wins over both.
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  preset: gspo\n  clip_ratio_high: 0.001\n  loss_agg: token-mean\n")
    algo = load_config(str(path), ["algorithm.loss_agg=seq-mean-token-sum"]).algorithm
    assert algo.policy_loss == "gspo" and algo.clip_ratio_low == pytest.approx(3e-4)
    assert algo.clip_ratio_high == pytest.approx(0.001) and algo.loss_agg == "seq-mean-token-sum"
    assert AlgorithmConfig.from_preset("drgrpo", kl_coef=0.1).kl_coef == 0.1


def test_kl_coef_on_top_of_a_no_kl_preset_turns_the_kl_on():
    algo = load_config(None, ["algorithm.preset=dapo", "algorithm.kl_coef=0.01"]).algorithm
    assert algo.kl_placement == "loss" and algo.needs_ref_model


def test_saved_preset_config_round_trips(tmp_path):
    cfg = load_config(None, ["algorithm.preset=dapo", "algorithm.clip_ratio_high=0.3"])
    save_config(cfg, str(tmp_path / "config.yaml"))
    assert load_config(str(tmp_path / "config.yaml")) == cfg


def test_unknown_preset_lists_the_valid_ones(tmp_path):
    for make in (
        lambda: load_config(None, ["algorithm.preset=ppo2"]),
        lambda: AlgorithmConfig.from_preset("ppo2"),
        lambda: AlgorithmConfig(preset="ppo2"),
    ):
        with pytest.raises(ValueError) as err:
            make()
        msg = str(err.value)
        assert "'algorithm.preset'" in msg and "ppo2" in msg and all(p in msg for p in PRESETS), msg
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  preset: nope\n")
    with pytest.raises(ValueError, match=r"'algorithm\.preset'.*nope"):
        load_config(str(path))


# ---------------------------------------------------------------------------- clip bounds
def test_loss_clip_defaults_cover_every_loss():
    assert set(LOSS_CLIP_DEFAULTS) == set(POLICY_LOSSES)


@pytest.mark.parametrize("loss,low,high", [("ppo_clip", 0.2, 0.2), ("gspo", 3e-4, 4e-4), ("cispo", None, 0.2)])
def test_auto_clip_bounds_are_the_loss_defaults(loss, low, high):
    for algo in (AlgorithmConfig(policy_loss=loss), load_config(None, [f"algorithm.policy_loss={loss}"]).algorithm):
        assert algo.clip_ratio_low == "auto" and algo.clip_ratio_high == "auto"
        got_low, got_high = algo.clip_bounds()
        assert got_low == (pytest.approx(low) if low is not None else None)
        assert got_high == pytest.approx(high)


def test_explicit_and_null_clip_bounds():
    algo = load_config(None, ["algorithm.policy_loss=cispo", "algorithm.clip_ratio_low=0.1"]).algorithm
    assert algo.clip_bounds() == (0.1, 0.2)  # CISPO's lower bound only when set
    algo = load_config(None, ["algorithm.clip_ratio_low=null", "algorithm.clip_ratio_high=1"]).algorithm
    assert algo.clip_bounds() == (None, 1.0) and isinstance(algo.clip_ratio_high, float)


# ---------------------------------------------------------------------------- validation of every new key
@pytest.mark.parametrize(
    "override,key,listed",
    [
        ("algorithm.kl_placement=actor", "algorithm.kl_placement", ["loss", "reward", "none"]),
        ("algorithm.kl_controller=pid", "algorithm.kl_controller", ["fixed", "adaptive"]),
        ("algorithm.rollout_correction=tis", "algorithm.rollout_correction", list(CORRECTION_MODES)),
        ("algorithm.kl_estimator=k4", "algorithm.kl_estimator", ["k1", "k2", "k3"]),
        ("algorithm.target_kl=0", "algorithm.target_kl", []),
        ("algorithm.kl_horizon=0", "algorithm.kl_horizon", []),
        ("algorithm.entropy_coef=-0.1", "algorithm.entropy_coef", []),
        ("algorithm.correction_cap=0", "algorithm.correction_cap", []),
        ("algorithm.correction_lower=2.0", "algorithm.correction_lower", []),  # must be below the cap (2.0)
        ("algorithm.correction_lower=0", "algorithm.correction_lower", []),
        ("algorithm.max_sampling_rounds=0", "algorithm.max_sampling_rounds", []),
        ("algorithm.overlong_penalty_factor=-1", "algorithm.overlong_penalty_factor", []),
        ("algorithm.overlong_buffer_len=-1", "algorithm.overlong_buffer_len", []),
        ("algorithm.clip_ratio_low=-0.1", "algorithm.clip_ratio_low", []),
        ("algorithm.clip_ratio_high=wide", "algorithm.clip_ratio_high", ["auto", "null"]),
        ("algorithm.dynamic_sampling=maybe", "algorithm.dynamic_sampling", []),
    ],
)
def test_bad_algorithm_value_names_the_key(override, key, listed):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert f"'{key}'" in msg, msg
    assert all(name in msg for name in listed), msg


@pytest.mark.parametrize(
    "overrides",
    [
        "algorithm.kl_placement=reward algorithm.kl_controller=adaptive algorithm.target_kl=0.05 "
        "algorithm.kl_horizon=500",
        "algorithm.rollout_correction=mis_seq algorithm.correction_cap=3.0 algorithm.correction_lower=0.5",
        "algorithm.dynamic_sampling=true algorithm.max_sampling_rounds=1",
        "algorithm.overlong_filter=true algorithm.overlong_penalty_factor=0.5 algorithm.overlong_buffer_len=0",
        "algorithm.entropy_coef=0.01 algorithm.kl_estimator=low_var_kl",
    ],
)
def test_good_algorithm_values_are_accepted(overrides):
    algo = load_config(None, overrides.split()).algorithm
    for item in overrides.split():
        key, value = item.split("=")
        got = getattr(algo, key.split(".")[1])
        assert str(got).lower() == value.lower() or got == pytest.approx(float(value))


@pytest.mark.parametrize(
    "placement,coef,needs",
    [("loss", 0.1, True), ("reward", 0.1, True), ("none", 0.1, False), ("loss", 0.0, False), ("reward", 0.0, False)],
)
def test_reference_model_only_when_a_kl_uses_it(placement, coef, needs):
    assert AlgorithmConfig(kl_placement=placement, kl_coef=coef).needs_ref_model is needs


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "dapo", "gspo"])
def test_constructor_with_only_a_preset_name_is_refused(name):
    """`AlgorithmConfig(preset="dapo")` would record the name and run the defaults (plain GRPO for dapo)."""
    from hybrid_rl.config.schema import AlgorithmConfig

    with pytest.raises(ValueError, match=rf"'{name}' is named but none of its values.*from_preset\('{name}'"):
        AlgorithmConfig(preset=name)
    built = AlgorithmConfig.from_preset(name)
    # One of the preset's keys set back to its default is an explicit choice, not a forgotten preset.
    if name == "dapo":
        assert (
            AlgorithmConfig.from_preset(name, dynamic_sampling=False).clip_ratio_high == built.clip_ratio_high == 0.28
        )
