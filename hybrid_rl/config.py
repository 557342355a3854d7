"""Configuration schema: the single source of truth for every setting.

Dataclasses with defaults, validated in `__post_init__` (a bad value raises
`ValueError` naming the key). OmegaConf is used only to merge a YAML file and
`key.sub=value` command-line overrides onto the schema; unknown keys fail there
with the key named.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key '{key}': {msg}")


def _one_of(value: Any, key: str, choices: Sequence[str]) -> None:
    _check(value in choices, key, f"got {value!r}, expected one of {list(choices)}")


@dataclass
class ModelConfig:
    path: str = ""  # local Hugging Face directory (config.json + safetensors + tokenizer)
    dtype: str = "auto"  # "auto": bf16 mixed precision on CUDA, fp32 on CPU
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        _one_of(self.dtype, "model.dtype", ["auto", "float32", "bfloat16"])
        _one_of(self.attn_implementation, "model.attn_implementation", ["sdpa", "eager", "flash_attention_2"])


@dataclass
class DataConfig:
    task: str = "digits"  # a built-in generated task, or "jsonl"
    path: str = ""  # for task=jsonl: a local .jsonl file, one object per line
    prompt_key: str = "prompt"
    batch_size: int = 32  # prompts per step, over all ranks
    num_prompts: int = 4096  # size of a generated task's prompt set
    chat_template: bool = False  # wrap prompts with the tokenizer's chat template
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.batch_size > 0, "data.batch_size", f"must be > 0, got {self.batch_size}")
        _check(self.num_prompts > 0, "data.num_prompts", f"must be > 0, got {self.num_prompts}")
        if self.task == "jsonl":
            _check(bool(self.path), "data.path", "is required when data.task=jsonl")


@dataclass
class RolloutConfig:
    engine: str = "native"
    n: int = 8  # samples per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)  # EOS always stops
    seed: int = 0

    def __post_init__(self) -> None:
        _one_of(self.engine, "rollout.engine", ["native"])  # sglang: see rollout/base.py
        _check(self.n >= 2, "rollout.n", f"GRPO needs at least 2 samples per prompt to form a group baseline, got {self.n}")
        _check(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k > 0, "rollout.top_k", f"must be -1 (off) or > 0, got {self.top_k}")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", f"must be > 0, got {self.max_new_tokens}")


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"
    policy_loss: str = "ppo_clip"
    loss_agg: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = None  # dual clip for negative advantages
    kl_coef: float = 0.0  # k-estimator KL to the reference, as a loss term
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # sequences per optimizer step over all ranks; 0 = the whole batch
    adv_eps: float = 1e-6

    def __post_init__(self) -> None:
        from hybrid_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
        from hybrid_rl.algorithms.aggregation import LOSS_AGG_MODES
        from hybrid_rl.algorithms.losses import POLICY_LOSSES

        _one_of(self.advantage, "algorithm.advantage", sorted(ADVANTAGE_ESTIMATORS))
        _one_of(self.policy_loss, "algorithm.policy_loss", sorted(POLICY_LOSSES))
        _one_of(self.loss_agg, "algorithm.loss_agg", LOSS_AGG_MODES)
        _one_of(self.kl_estimator, "algorithm.kl_estimator", ["k1", "k2", "k3"])
        _check(self.clip_ratio_low >= 0, "algorithm.clip_ratio_low", "must be >= 0")
        _check(self.clip_ratio_high >= 0, "algorithm.clip_ratio_high", "must be >= 0")
        _check(self.clip_ratio_c is None or self.clip_ratio_c > 1, "algorithm.clip_ratio_c", "must be > 1 (or null)")
        _check(self.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
        _check(self.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be >= 1")
        _check(self.mini_batch_size >= 0, "algorithm.mini_batch_size", "must be >= 0 (0 = whole batch)")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", "must be two values in [0, 1)")
        _check(self.grad_clip > 0, "optim.grad_clip", "must be > 0")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")


@dataclass
class OffloadConfig:
    """What leaves the compute device outside the phase that uses it (hybrid/offload.py)."""

    optimizer: bool = False  # optimizer state on host outside TRAIN
    ref: bool = True  # reference model on host outside SCORE
    params: bool = False  # policy parameter shards on host during ROLLOUT (engines with their own copy)
    reward_model: bool = False  # reward model on host outside its phase (warns if the run has none)
    auto: bool = False  # ignore the flags above and take the planner's advice (python -m hybrid_rl.plan)


@dataclass
class RewardConfig:
    name: str = "digits"  # a registered reward function

    def __post_init__(self) -> None:
        _check(bool(self.name), "reward.name", "is empty")


@dataclass
class TrainerConfig:
    total_steps: int = 100
    micro_batch_size: int = 64  # sequences per forward/backward on one rank
    out_dir: str = "runs/default"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    dist_timeout_s: int = 300
    progress_bar: bool = True
    log_every: int = 1

    def __post_init__(self) -> None:
        _check(self.total_steps > 0, "trainer.total_steps", "must be > 0")
        _check(self.micro_batch_size > 0, "trainer.micro_batch_size", "must be > 0")
        _one_of(self.device, "trainer.device", ["auto", "cpu", "cuda"])
        _check(self.dist_timeout_s > 0, "trainer.dist_timeout_s", "must be > 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate_runtime(self, world_size: int) -> None:
        """Checks that need the machine (paths, ranks); raised before any model is built."""
        _check(bool(self.model.path), "model.path", "is empty; point it at a local Hugging Face model directory")
        _check(os.path.isdir(self.model.path), "model.path",
               f"directory {self.model.path!r} does not exist; give a local Hugging Face model directory")
        _check(os.path.isfile(os.path.join(self.model.path, "config.json")), "model.path",
               f"{self.model.path!r} has no config.json; is it a Hugging Face model directory?")
        b = self.data.batch_size
        _check(b % world_size == 0, "data.batch_size",
               f"{b} prompts do not divide over {world_size} ranks; use a multiple of {world_size}")
        n_seq = b * self.rollout.n
        mb = self.algorithm.mini_batch_size or n_seq
        _check(n_seq % mb == 0, "algorithm.mini_batch_size",
               f"{mb} does not divide the {n_seq} sequences of a step (data.batch_size x rollout.n)")
        _check(mb % world_size == 0, "algorithm.mini_batch_size",
               f"{mb} sequences do not divide over {world_size} ranks")


def _schema_error(err: OmegaConfBaseException) -> ValueError:
    key = getattr(err, "full_key", None) or ""
    return ValueError(f"config key '{key}': {err.msg if hasattr(err, 'msg') else err}".strip())


def load_config(yaml_path: Optional[str] = None, overrides: Sequence[str] = (), base: Optional[Config] = None) -> Config:
    """Build a validated `Config` from (base dataclass) <- YAML <- `key.sub=value` overrides."""
    schema = OmegaConf.structured(base if base is not None else Config)
    try:
        layers = [schema]
        if yaml_path:
            if not os.path.isfile(yaml_path):
                raise FileNotFoundError(f"config file {yaml_path!r} does not exist")
            layers.append(OmegaConf.load(yaml_path))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"command-line override {bad[0]!r} is not of the form key.sub=value")
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)  # runs every __post_init__
    except OmegaConfBaseException as err:
        raise _schema_error(err) from None


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config as YAML (the run directory's record of what ran)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
