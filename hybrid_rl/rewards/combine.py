"""A run's reward from its parts: the rule reward, the reward model's score, or a weighted sum.

`reward.weights` names the parts and their weights, e.g. {rule: 1.0, model: 0.5}. A part
with weight 0 is still computed and logged (`reward/rule_mean`, ...) but adds nothing:
a verifier can watch a run trained on a reward model. Without `reward.weights` a run
uses the rule reward alone, or the model alone when `reward.model_path` is set.

With `reward.normalize_model` the model's score is standardised by the running mean
and standard deviation of every score seen so far (all ranks, this batch included)
before it is weighted: a reward model's scale is arbitrary, a rule reward's is not.
The normaliser's state is small and JSON-safe, so a checkpoint can carry it.

Legend: N completions on this rank.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from hybrid_rl.runtime import distributed as D

PARTS = ("rule", "model", "env")  # env: an episode's summed step rewards (envs/, envs/episodes.py)


def resolve_weights(weights: Mapping[str, float], has_model: bool, has_env: bool = False) -> dict[str, float]:
    """The parts a run computes, with their weights (config/schema.py has checked the keys). Without weights: the
    environment's reward alone when there is one, else the reward model's, else the rule reward."""
    if weights:
        return {k: float(weights[k]) for k in PARTS if k in weights}
    return {"env": 1.0} if has_env else {"model": 1.0} if has_model else {"rule": 1.0}


class RunningNorm:
    """Running mean and variance of every value seen, over all ranks (Chan et al.'s parallel update).

    Every rank calls `update` with its own values at the same time (one all-reduce), so
    every rank holds the same statistics and normalises the same way.
    """

    def __init__(self, eps: float = 1e-6):
        self.eps = eps
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0  # m2: sum of squared deviations from the mean

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 1.0

    def update(self, x_N: torch.Tensor) -> None:
        x = x_N.detach().double().cpu()
        n_sum = D.all_reduce_sum(torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum()]))
        n = n_sum[0].item()
        if n == 0:
            return
        mean_b = n_sum[1].item() / n
        # The batch's squared deviations about its global mean: a second (tiny) reduction, exact.
        m2_b = D.all_reduce_sum(((x - mean_b) ** 2).sum().reshape(1))[0].item()
        total = self.count + n
        delta = mean_b - self.mean
        self.mean += delta * n / total
        self.m2 += m2_b + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, x_N: torch.Tensor) -> torch.Tensor:
        return ((x_N.double() - self.mean) / max(self.std, self.eps)).to(x_N.dtype)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "eps": self.eps}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            raise ValueError(f"reward normaliser state lacks {sorted(missing)}")
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
        self.eps = float(state.get("eps", self.eps))


def combine(
    parts: Mapping[str, torch.Tensor], weights: Mapping[str, float], norm: Optional[RunningNorm] = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(reward_N, logged parts): sum over parts of weight x part, the model part normalised first if `norm`.

    parts: {"rule": rule_N, "model": score_N, "env": return_N} (the parts in `weights`, all of shape (N,)).
    Logged parts: rule and model as given, plus model_norm when normalised.
    """
    if set(parts) != set(weights):
        raise ValueError(f"reward parts {sorted(parts)} do not match the weighted parts {sorted(weights)}")
    shapes = {tuple(p.shape) for p in parts.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"every reward part must be one value per completion (N,), got shapes {sorted(shapes)}")
    logged = {k: v.float() for k, v in parts.items()}
    used = dict(logged)
    if norm is not None and "model" in used:
        norm.update(used["model"])
        used["model"] = logged["model_norm"] = norm.normalize(used["model"])
    reward_N = torch.zeros_like(next(iter(used.values())))
    for k, w in weights.items():
        reward_N = reward_N + w * used[k]
    return reward_N, logged
