"""The learning-rate multiplier per optimizer step: linear warm-up, then constant or a decay to a floor.

`lr_factor(s, ...)` is what `torch.optim.lr_scheduler.LambdaLR` multiplies the base lr by
before optimizer step s + 1 (s counts the steps already taken, from 0). Warm-up ramps
(s + 1) / warmup; the decay then runs over the remaining steps so that the last
optimizer step of the run (s = total - 1) uses lr * min_ratio, and stays there after it.
A decaying schedule spans the run's length, so resuming with another `trainer.total_steps`
is refused (checkpoint.check_compatible) unless `trainer.resume_ignore` lists it: the
schedule is then re-planned over the new length and the lr jumps to it at the next step.
"""

from __future__ import annotations

import math


def lr_factor(s: int, warmup: int, total: int, kind: str = "constant", min_ratio: float = 0.0) -> float:
    if warmup and s < warmup:
        return (s + 1) / warmup
    if kind == "constant":
        return 1.0
    span = total - 1 - warmup  # optimizer steps after the first one at full lr
    frac = 1.0 if span <= 0 else min(1.0, (s - warmup) / span)
    if kind == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * frac))
    elif kind == "linear":
        decay = 1.0 - frac
    else:
        raise ValueError(f"unknown lr schedule {kind!r}; expected constant, cosine or linear")
    return min_ratio + (1.0 - min_ratio) * decay


def optimizer_steps(total_steps: int, batch_sequences: int, mini_batch_size: int, ppo_epochs: int) -> int:
    """Optimizer steps in a run: per GRPO step, ppo_epochs x (sequences / mini-batch)."""
    return total_steps * ppo_epochs * (batch_sequences // (mini_batch_size or batch_sequences))
