"""`model.lora.*`: the LoRA settings of the schema (config.py), kept torch-free like the rest of it (the
planner imports the schema without torch). What they do is models/lora.py (peft); the checks that need the
model's layers or the engine run before a model is built (config_checks.validate_runtime)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from hybrid_rl.config_checks import check

LORA_ALL_LINEAR = "all-linear"


@dataclass
class LoraSettings:
    """`model.lora.*`, LoRA through peft (models/lora.py). rank 0 = LoRA off (the whole policy trains)."""

    rank: int = 0
    alpha: float = 32.0  # peft's lora_alpha: the update is scaled by alpha / rank
    # Applied in the update only (train mode); scoring runs in eval mode, so a non-zero value biases the
    # PPO ratio the way model dropout would (models/fsdp.py prepare_policy). verl's default is 0.
    dropout: float = 0.0
    # "all-linear" (every Linear but the LM head, as peft) or a list of module names, e.g. [q_proj, v_proj]
    target_modules: Union[str, list[str]] = LORA_ALL_LINEAR

    def __post_init__(self) -> None:
        check(isinstance(self.rank, int) and self.rank >= 0, "model.lora.rank",
              f"must be an integer >= 0 (0 = off), got {self.rank!r}")
        check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha!r}")
        check(0.0 <= self.dropout < 1.0, "model.lora.dropout", f"must be in [0, 1), got {self.dropout!r}")
        tm = self.target_modules
        if isinstance(tm, str):
            check(tm == LORA_ALL_LINEAR, "model.lora.target_modules", f"a string must be {LORA_ALL_LINEAR!r}; got "
                  f"{tm!r} (give a list of module names, e.g. [q_proj, v_proj])")
            return
        tm = list(tm)
        check(len(tm) > 0 and all(isinstance(t, str) and t for t in tm), "model.lora.target_modules",
              f"must be {LORA_ALL_LINEAR!r} or a non-empty list of module names, got {tm!r}")
        check(len(set(tm)) == len(tm), "model.lora.target_modules", f"lists a name twice: {tm!r}")
        self.target_modules = tm

    @property
    def enabled(self) -> bool:
        return self.rank > 0
