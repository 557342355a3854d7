"""hybrid_rl: colocated hybrid-engine RL post-training for LLMs.

`Trainer` and `Config` are imported lazily so that `import hybrid_rl.algorithms`
stays light (no transformers import) in tests and tools.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Config", "Trainer", "load_config"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from hybrid_rl.trainer import Trainer

        return Trainer
    if name == "Config":
        from hybrid_rl.config.schema import Config

        return Config
    if name == "load_config":
        from hybrid_rl.config.load import load_config

        return load_config
    raise AttributeError(f"module 'hybrid_rl' has no attribute {name!r}")
