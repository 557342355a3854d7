"""Shared by the checkpoint tests: a reward that draws from every RNG a user's code might
use, and "2k steps" vs "k steps, stop, resume for k more" on the real Trainer."""

from __future__ import annotations

import os
import random
from typing import Sequence

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Metrics that are wall-clock or machine noise; everything else must match to the bit.
NOISE = ("time/", "switch/")


def noisy_digits(prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]) -> list[float]:
    """The digits reward plus a little noise from Python's, NumPy's and torch's global RNGs:
    a resume that does not restore one of them changes the rewards after it."""
    from hybrid_rl.rewards.toy import digits_reward

    base = digits_reward(prompts, completions, metadata)
    return [r + 1e-3 * (random.random() + float(np.random.rand()) + torch.rand(()).item()) for r in base]


def overrides(model_dir: str, out_dir: str, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "data.batch_size=4",
        "rollout.n=4",
        "rollout.max_new_tokens=4",
        f"trainer.out_dir={out_dir}",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "optim.lr=2e-3",
        # Not the recipe's: its cosine decay (to 20%) refuses a resume with another total_steps (done
        # here), and its mini_batch_size (= data.batch_size) must be a multiple of rollout.n (some set 8).
        "optim.lr_schedule=constant",
        "optim.min_lr_ratio=0.0",
        "algorithm.mini_batch_size=0",
        "reward.fn=tests.checkpoint_helpers:noisy_digits",
        "trainer.log_every=0",
        *extra,
    ]


def comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(NOISE) and k != "bottleneck"}


def weights(trainer) -> dict[str, torch.Tensor]:
    """This rank's parameter shards and optimizer state, on the host."""
    out = {}
    for name, p in trainer.policy.named_parameters():
        out[name] = (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
    for i, state in enumerate(trainer.optimizer.state.values()):
        for key, v in state.items():
            if torch.is_tensor(v):
                out[f"optim.{i}.{key}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    return out


def straight_and_resumed(model_dir: str, out: str, k: int, *extra: str, offload_copies: bool = False) -> dict:
    """Run 2k steps straight; run k steps with a checkpoint, then a new Trainer resumed for k more.

    Returns both histories after step k and both final weights (this rank's)."""
    from hybrid_rl import Trainer, load_config

    def make(out_dir: str, *more: str):
        cfg = load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides(model_dir, out_dir, *extra, *more))
        trainer = Trainer(cfg)
        if offload_copies and trainer.phases.opt_offload is not None:
            trainer.phases.opt_offload.always_copy = True  # CPU: real copies through the offload path
        return trainer

    straight = make(os.path.join(out, "straight"), f"trainer.total_steps={2 * k}")
    full = straight.fit()
    first = make(os.path.join(out, "resumed"), f"trainer.total_steps={k}", f"trainer.save_every={k}")
    first.fit()
    first.close()
    second = make(os.path.join(out, "resumed"), f"trainer.total_steps={2 * k}")
    assert second.step_idx == k, f"resumed at step {second.step_idx}, expected {k}"
    rest = second.fit()
    second.save_checkpoint()  # step 2k: what the export checks read
    from hybrid_rl.models.saving import full_state_dict

    return {
        "full_weights": full_state_dict(second.policy),  # a collective: every rank calls it
        "straight": [comparable(m) for m in full[k:]],
        "resumed": [comparable(m) for m in rest],
        "straight_weights": weights(straight),
        "resumed_weights": weights(second),
        "loader": (straight.state.loader.state_dict(), second.state.loader.state_dict()),
        "resumed_dir": os.path.join(out, "resumed"),
    }


def assert_same_run(result: dict) -> None:
    a, b = result["straight"], result["resumed"]
    assert len(a) == len(b) and a, (len(a), len(b))
    for ma, mb in zip(a, b):
        diff = {k: (ma.get(k), mb.get(k)) for k in set(ma) | set(mb) if ma.get(k) != mb.get(k)}
        assert not diff, f"step {ma['step']}: metrics differ after resume: {sorted(diff.items())[:6]}"
    wa, wb = result["straight_weights"], result["resumed_weights"]
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs after resume"
    assert result["loader"][0] == result["loader"][1]


CALLS = {"n": 0, "signal_at": 0}


def interrupting_digits(prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]) -> list[float]:
    """The digits reward; its call number CALLS["signal_at"] sends this process SIGINT (a Ctrl-C mid-step)."""
    import signal

    from hybrid_rl.rewards.toy import digits_reward

    CALLS["n"] += 1
    if CALLS["n"] == CALLS["signal_at"]:
        signal.raise_signal(signal.SIGINT)
    return digits_reward(prompts, completions, metadata)
