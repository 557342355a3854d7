"""Config schema: YAML + dotlist merging, unknown keys, bad values, runtime checks, save/load round trip.

Every error is a ValueError whose message names the offending key, so a user
knows which line of a YAML file or which override to fix.
"""

from __future__ import annotations

import os
from dataclasses import asdict as to_dict
from dataclasses import dataclass, field
from typing import Literal, get_args, get_type_hints

import pytest
import yaml

from hybrid_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from hybrid_rl.algorithms.aggregation import LOSS_AGG_MODES
from hybrid_rl.config.load import load_config, save_config
from hybrid_rl.config.schema import Config, RolloutConfig
from hybrid_rl.loop.preflight import validate_runtime


def _write(path, text):
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------- merging
def test_defaults_without_yaml_or_overrides():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg == Config()
    assert cfg.rollout.n == 8 and cfg.data.batch_size == 32 and cfg.algorithm.advantage == "grpo"


def test_yaml_then_dotlist_overrides(tmp_path):
    path = _write(
        tmp_path / "c.yaml",
        """
rollout:
  n: 4
  temperature: 0.7
  stop_token_ids: [5, 6]
data:
  batch_size: 16
algorithm:
  clip_ratio_c: 3.0
""",
    )
    cfg = load_config(
        path, ["rollout.n=6", "optim.lr=3e-4", "trainer.progress_bar=false", "algorithm.loss_agg=seq-mean-token-mean"]
    )
    assert cfg.rollout.n == 6  # the command line wins over the YAML
    assert cfg.rollout.temperature == 0.7  # YAML wins over the default
    assert cfg.rollout.stop_token_ids == [5, 6]
    assert cfg.data.batch_size == 16
    assert cfg.algorithm.clip_ratio_c == 3.0
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.trainer.progress_bar is False
    assert cfg.algorithm.loss_agg == "seq-mean-token-mean"
    # untouched keys keep their defaults
    assert cfg.rollout.top_p == 1.0 and cfg.data.num_prompts == Config().data.num_prompts
    assert isinstance(cfg.rollout, RolloutConfig)


def test_overrides_without_yaml_are_typed():
    cfg = load_config(None, ["rollout.max_new_tokens=5", "data.seed=3", "model.path=/x/y"])
    assert cfg.rollout.max_new_tokens == 5 and isinstance(cfg.rollout.max_new_tokens, int)
    assert cfg.data.seed == 3 and cfg.model.path == "/x/y"


def test_base_config_is_the_bottom_layer():
    base = load_config(None, ["rollout.n=4", "data.batch_size=8"])
    cfg = load_config(None, ["data.batch_size=12"], base=base)
    assert cfg.rollout.n == 4 and cfg.data.batch_size == 12


# ---------------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize(
    "override,key",
    [
        ("trainer.nope=1", "trainer.nope"),
        ("nope.x=1", "nope"),
        ("rollout.temprature=0.5", "rollout.temprature"),
    ],
)
def test_unknown_override_key_names_the_key(override, key):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    assert f"'{key}'" in str(err.value)


def test_unknown_yaml_section_names_the_key(tmp_path):
    path = _write(tmp_path / "c.yaml", "rollout:\n  n: 4\nfoo:\n  bar: 1\n")
    with pytest.raises(ValueError, match="'foo'"):
        load_config(path)


def test_unknown_yaml_key_in_known_section_names_the_key(tmp_path):
    path = _write(tmp_path / "c.yaml", "rollout:\n  n: 4\n  bogus: 2\n")
    with pytest.raises(ValueError, match=r"'rollout\.bogus'"):
        load_config(path)


def test_override_without_equals_sign():
    with pytest.raises(ValueError, match="rollout.n 4"):
        load_config(None, ["rollout.n 4"])


def test_missing_yaml_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))


def test_wrong_type_names_the_key():
    with pytest.raises(ValueError, match=r"'rollout\.n'.*abc"):
        load_config(None, ["rollout.n=abc"])


# ---------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.n=1", "rollout.n"),
        ("rollout.n=0", "rollout.n"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("rollout.temperature=-1.0", "rollout.temperature"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.top_k=0", "rollout.top_k"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
        ("rollout.engine=tensorrt", "rollout.engine"),
        ("data.batch_size=0", "data.batch_size"),
        ("data.num_prompts=0", "data.num_prompts"),
        ("data.task=jsonl", "data.path"),  # jsonl needs a path
        ("optim.lr=-1", "optim.lr"),
        ("optim.lr=0", "optim.lr"),
        ("optim.betas=[0.9,1.0]", "optim.betas"),
        ("optim.grad_clip=0", "optim.grad_clip"),
        ("algorithm.loss_agg=bad", "algorithm.loss_agg"),
        ("algorithm.policy_loss=bad", "algorithm.policy_loss"),
        ("algorithm.kl_estimator=k9", "algorithm.kl_estimator"),
        ("algorithm.clip_ratio_c=1.0", "algorithm.clip_ratio_c"),
        ("algorithm.ppo_epochs=0", "algorithm.ppo_epochs"),
        ("algorithm.mini_batch_size=-1", "algorithm.mini_batch_size"),
        ("algorithm.kl_coef=-0.1", "algorithm.kl_coef"),
        ("model.dtype=float16", "model.dtype"),
        ("trainer.device=tpu", "trainer.device"),
        ("trainer.total_steps=0", "trainer.total_steps"),
        ("reward.name=", "reward.name"),
        ("data.task=csv", "data.task"),
        ("data.task=parquet", "data.path"),  # a parquet file needs a path too
        ("data.prompt_key=", "data.prompt_key"),
        ("data.max_prompt_tokens=-1", "data.max_prompt_tokens"),
        ("rollout.engine_timeout_s=0", "rollout.engine_timeout_s"),
        ("data.val_split=1.0", "data.val_split"),
        ("data.val_split=-0.1", "data.val_split"),
        ("data.val_size=0", "data.val_size"),
        ("data.val_batch_size=0", "data.val_batch_size"),
        ("reward.fn=no_colon", "reward.fn"),
        ("reward.fn=:fn", "reward.fn"),
        ("trainer.loggers=[console,mlflow]", "trainer.loggers"),
        ("trainer.loggers=[console,console]", "trainer.loggers"),
        ("trainer.wandb_mode=cloud", "trainer.wandb_mode"),
        ("trainer.val_every=-1", "trainer.val_every"),
        ("trainer.val_n=-2", "trainer.val_n"),
        ("trainer.val_sample_rows=-1", "trainer.val_sample_rows"),
        ("trainer.log_every=-1", "trainer.log_every"),
    ],
)
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    assert f"config key '{key}'" in str(err.value)


def test_bad_advantage_lists_valid_names():
    with pytest.raises(ValueError) as err:
        load_config(None, ["algorithm.advantage=xyz"])
    msg = str(err.value)
    assert "'algorithm.advantage'" in msg and "xyz" in msg
    assert ADVANTAGE_ESTIMATORS and all(name in msg for name in ADVANTAGE_ESTIMATORS)


def test_bad_loss_agg_lists_valid_modes():
    with pytest.raises(ValueError) as err:
        load_config(None, ["algorithm.loss_agg=bad"])
    assert all(mode in str(err.value) for mode in LOSS_AGG_MODES)


def test_bad_value_in_yaml_names_the_key(tmp_path):
    path = _write(tmp_path / "c.yaml", "rollout:\n  n: 1\n")
    with pytest.raises(ValueError, match=r"'rollout\.n'.*at least 2"):
        load_config(path)


def test_dataclass_validates_directly():
    from hybrid_rl.config.schema import AlgorithmConfig, Config

    with pytest.raises(ValueError, match=r"'rollout\.n'"):
        RolloutConfig(n=0)
    with pytest.raises(ValueError, match=r"'rollout\.n'.*group"):
        Config(rollout=RolloutConfig(n=1))  # the group-size rule spans sections: the Config checks it
    Config(rollout=RolloutConfig(n=1), algorithm=AlgorithmConfig(advantage="reinforce_pp"))


@pytest.mark.parametrize(
    "override",
    [
        "rollout.n=2",
        "rollout.top_k=1",
        "rollout.top_p=1.0",
        "algorithm.clip_ratio_c=null",
        "algorithm.mini_batch_size=0",
        "model.dtype=bfloat16",
        "data.task=jsonl data.path=x.jsonl",
        "data.task=gsm8k",
        "data.val_split=0.0",
        "data.chat_template=null",
        "reward.fn=pkg.mod:fn",
        "trainer.loggers=[]",
    ],
)
def test_boundary_values_are_accepted(override):
    load_config(None, override.split())


# ---------------------------------------------------------------------------- runtime checks
@pytest.fixture
def model_dir(tmp_path):
    """validate_runtime only looks for the directory and its config.json: no model needs building."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


def _cfg(model_dir, *overrides):
    return load_config(None, [f"model.path={model_dir}", *overrides])


def test_validate_runtime_accepts_a_good_setup(model_dir):
    cfg = _cfg(model_dir, "data.batch_size=32", "rollout.n=4")
    for world in (1, 2, 4, 8, 16, 32):
        validate_runtime(cfg, world)


def test_validate_runtime_batch_not_divisible_by_ranks(model_dir):
    cfg = _cfg(model_dir, "data.batch_size=32")
    with pytest.raises(ValueError) as err:
        validate_runtime(cfg, 3)
    msg = str(err.value)
    assert "'data.batch_size'" in msg and "32" in msg and "3 ranks" in msg


def test_validate_runtime_mini_batch_does_not_divide_step(model_dir):
    cfg = _cfg(model_dir, "data.batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=3")
    with pytest.raises(ValueError, match=r"'algorithm\.mini_batch_size'.*3 does not divide the 8 sequences"):
        validate_runtime(cfg, 1)
    validate_runtime(_cfg(model_dir, "data.batch_size=4", "rollout.n=2", "algorithm.mini_batch_size=4"), 1)


def test_validate_runtime_mini_batch_not_divisible_by_ranks(model_dir):
    # 16 sequences, mini-batches of 4, over 8 ranks: a mini-batch cannot be split evenly.
    cfg = _cfg(model_dir, "data.batch_size=8", "rollout.n=2", "algorithm.mini_batch_size=4")
    validate_runtime(cfg, 4)
    with pytest.raises(ValueError, match=r"'algorithm\.mini_batch_size'.*8 ranks"):
        validate_runtime(cfg, 8)


@pytest.mark.parametrize("kind", ["empty", "missing", "no_config_json"])
def test_validate_runtime_bad_model_path(tmp_path, kind):
    path = {"empty": "", "missing": str(tmp_path / "no_such_dir"), "no_config_json": str(tmp_path)}[kind]
    cfg = load_config(None, [f"model.path='{path}'"])
    assert cfg.model.path == path
    with pytest.raises(ValueError) as err:
        validate_runtime(cfg, 1)
    assert "'model.path'" in str(err.value)
    if path:
        assert path in str(err.value)


# ---------------------------------------------------------------------------- save / load
def test_save_config_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            "model.path=/models/x",
            "rollout.n=4",
            "rollout.temperature=0.7",
            "rollout.stop_token_ids=[5,6]",
            "algorithm.clip_ratio_c=3.0",
            "algorithm.advantage=rloo",
            "optim.betas=[0.8,0.95]",
            "trainer.progress_bar=false",
            "data.task=jsonl",
            "data.path=rows.jsonl",
            "offload.optimizer=true",
        ],
    )
    path = str(tmp_path / "sub" / "config.yaml")
    save_config(cfg, path)
    assert os.path.isfile(path)
    back = load_config(path)
    assert back == cfg
    assert to_dict(back) == to_dict(cfg)
    # The file is plain YAML holding every section, readable without hybrid_rl.
    raw = yaml.safe_load(open(path))
    assert set(raw) == set(to_dict(cfg))
    assert (
        raw["rollout"]["n"] == 4
        and raw["algorithm"]["clip_ratio_c"] == 3.0
        and raw["rollout"]["stop_token_ids"] == [5, 6]
    )


def test_save_config_round_trip_defaults(tmp_path):
    path = str(tmp_path / "config.yaml")
    save_config(Config(), path)
    assert load_config(path) == Config()


# ---------------------------------------------------------------------------- data, reward and trainer sections
def test_gsm8k_recipe_keys_merge_and_type(tmp_path):
    path = _write(
        tmp_path / "c.yaml",
        """
data:
  task: gsm8k
  max_prompt_tokens: 512
  chat_template: true
reward:
  name: gsm8k
  kwargs:
    mode: strict
trainer:
  loggers: [console, tensorboard]
  val_every: 5
""",
    )
    cfg = load_config(path, ["reward.kwargs.format_score=0.1", "trainer.val_n=4", "data.val_size=100"])
    assert cfg.data.task == "gsm8k" and cfg.data.max_prompt_tokens == 512 and cfg.data.chat_template is True
    assert cfg.reward.kwargs == {"mode": "strict", "format_score": 0.1}  # the command line adds to the YAML's
    assert cfg.trainer.loggers == ["console", "tensorboard"] and cfg.trainer.val_every == 5 and cfg.trainer.val_n == 4
    assert cfg.data.val_size == 100 and cfg.data.val_batch_size is None and cfg.data.instruction is None
    back = str(tmp_path / "saved.yaml")
    save_config(cfg, back)
    assert load_config(back) == cfg


def test_new_keys_default_to_the_old_behaviour():
    cfg = Config()
    assert cfg.data.chat_template is None and cfg.data.max_prompt_tokens == 0 and cfg.data.answer_key == ""
    assert cfg.data.num_prompts is None and cfg.data.val_split == 0.0 and not cfg.data.val_path
    assert cfg.reward.fn == "" and cfg.reward.kwargs == {} and cfg.reward.success_threshold is None
    assert cfg.trainer.loggers == ["console"] and cfg.trainer.val_every == 0 and cfg.trainer.wandb_mode == "offline"


def test_list_and_empty_value_errors_say_how_to_write_them():
    with pytest.raises(ValueError, match=r"'trainer.loggers'.*trainer.loggers=\[a,b\]"):
        load_config(None, ["trainer.loggers=console"])
    with pytest.raises(ValueError, match=r"'model.path'.*nothing after it is null"):
        load_config(None, ["model.path="])


# ---------------------------------------------------------------------------- choices (Literal keys)
def _choice_keys():
    """(section, field, allowed values, is a list) for every Literal / list[Literal] key of the schema."""
    out = []
    for section, cls in get_type_hints(Config).items():
        for name, annotation in get_type_hints(cls).items():
            is_list = getattr(annotation, "__origin__", None) is list
            inner = get_args(annotation)[0] if is_list else annotation
            if getattr(inner, "__origin__", None) is Literal:
                out.append((section, name, get_args(inner), is_list))
    return out


def test_the_schema_has_its_choice_keys():
    keys = {f"{s}.{n}" for s, n, _, _ in _choice_keys()}
    assert {
        "model.dtype",
        "data.task",
        "rollout.engine",
        "algorithm.advantage",
        "algorithm.loss_agg",
        "algorithm.kl_placement",
        "optim.lr_schedule",
        "trainer.device",
        "trainer.loggers",
    } <= keys
    # Registries a user extends at run time stay strings.
    assert "reward.name" not in keys and "reward.fn" not in keys


@pytest.mark.parametrize("section,name,choices,is_list", _choice_keys(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_value_outside_the_annotation_is_refused_with_the_choices(section, name, choices, is_list):
    """Mutation: check_choices skipped (a no-op) -> the dataclass accepts 'bogus'; the Literal rewrite in
    config.load._schema_error dropped -> OmegaConf's own message, keyed trainer.loggers[1]."""
    bad = ["bogus"] if is_list else "bogus"
    cls = get_type_hints(Config)[section]
    with pytest.raises(ValueError) as direct:
        cls(**{name: bad})
    text = "[bogus]" if is_list else "bogus"
    with pytest.raises(ValueError) as loaded:
        load_config(None, [f"{section}.{name}={text}"])
    assert str(direct.value) == f"config key '{section}.{name}': got 'bogus', expected one of {list(choices)}"
    # A preset name is looked up while merging (presets.preset_values words it); every other key reads as above.
    msg = str(loaded.value)
    assert msg.startswith(f"config key '{section}.{name}': ") and "'bogus'" in msg
    assert all(repr(c) in msg for c in choices if c), msg
    assert name == "preset" or msg == str(direct.value)


@pytest.mark.parametrize("section,name,choices,is_list", _choice_keys(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_value_of_the_annotation_is_accepted(section, name, choices, is_list):
    for choice in choices:
        value = f"['{choice}']" if is_list else f"'{choice}'"  # quoted: preset '' is none, a bare `key=` is null
        ppo = ["algorithm.advantage=gae"] if section == "critic" else []  # critic.* is PPO's
        split = ["trainer.placement=split"] if name == "inflight_update" else []  # a split placement's key
        partial = ["rollout.partial=true", "trainer.max_staleness=1"] if name == "partial_kv" else []  # its key
        cfg = load_config(None, [f"{section}.{name}={value}", "data.path=rows.jsonl", *ppo, *split, *partial])
        assert getattr(getattr(cfg, section), name) == ([choice] if is_list else choice)


def test_a_choice_added_to_the_annotation_needs_no_other_change():
    """The check reads the annotation: a new choice is accepted as soon as the Literal names it."""
    from hybrid_rl.config.checks import check_choices

    @dataclass
    class Old:
        mode: Literal["a", "b"] = "a"
        tags: list[Literal["x"]] = field(default_factory=list)

        def __post_init__(self):
            check_choices(self, "toy")

    @dataclass
    class New:  # the same section, one choice added to each annotation and nothing else
        mode: Literal["a", "b", "c"] = "a"
        tags: list[Literal["x", "y"]] = field(default_factory=list)

        def __post_init__(self):
            check_choices(self, "toy")

    with pytest.raises(ValueError, match=r"^config key 'toy.mode': got 'c', expected one of \['a', 'b'\]$"):
        Old(mode="c")
    with pytest.raises(ValueError, match=r"^config key 'toy.tags': got 'y', expected one of \['x'\]$"):
        Old(tags=["x", "y"])
    assert New(mode="c", tags=["x", "y"]).mode == "c"


def test_choices_agree_with_the_tables_they_name():
    """The algorithm and engine Literals are written out in config/schema.py (importable without torch, readable by a
    type checker); the tables that implement the names are the other half. Mutation: a name added to one only."""
    from hybrid_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from hybrid_rl.algorithms.correction import CORRECTION_MODES
    from hybrid_rl.algorithms.kl import KL_ESTIMATORS
    from hybrid_rl.algorithms.losses import POLICY_LOSSES
    from hybrid_rl.algorithms.presets import PRESETS
    from hybrid_rl.config import schema as config
    from hybrid_rl.rollout import base

    assert set(get_args(config.Preset)) == {"", *PRESETS}
    assert set(get_args(config.AdvantageName)) == set(ADVANTAGE_ESTIMATORS)
    assert set(get_args(config.PolicyLoss)) == set(POLICY_LOSSES)
    assert get_args(config.LossAgg) == tuple(LOSS_AGG_MODES)
    assert get_args(config.KLEstimator) == tuple(KL_ESTIMATORS)
    assert get_args(config.Correction) == tuple(CORRECTION_MODES)
    assert set(get_args(config.Engine)) == set(base._ENGINES)
