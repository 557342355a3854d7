"""The configuration: the schema (schema.py, dataclasses validated in __post_init__, no torch, no engine), the
helpers its checks call (checks.py), and loading YAML + `key.sub=value` overrides (load.py). The checks that need
the machine, the model or an engine are the loop's pre-flight (loop/preflight.py).
"""

from hybrid_rl.config.load import load_config, save_config
from hybrid_rl.config.schema import (
    AlgorithmConfig,
    Config,
    DataConfig,
    EnvConfig,
    LoraSettings,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "Config",
    "DataConfig",
    "EnvConfig",
    "LoraSettings",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "load_config",
    "save_config",
]
