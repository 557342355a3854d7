"""Outcome-reward advantage estimators for group-sampled RL (GRPO family).

Shape legend:
    N  number of sequences in the batch (B prompts x G samples each)
    B  number of prompts (groups); groups may have unequal sizes
    _N a tensor with one entry per sequence

Every estimator has the signature
    fn(rewards_N, group_ids_N, eps=1e-6) -> adv_N
where group_ids_N holds arbitrary integer ids (not necessarily contiguous or
sorted) saying which prompt each sequence was sampled from. The result is one
scalar per sequence; the trainer broadcasts it over the response tokens.

Statistics are computed in float64 and cast back, because GRPO divides by a
small std and float32 round-off in the group mean would otherwise leak into
groups whose rewards are all equal. Groups whose rewards are exactly equal get
an advantage of exactly 0 for every estimator that subtracts a group baseline.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
    "grpo_advantages",
    "drgrpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
]


def _check_inputs(rewards_N: Tensor, group_ids_N: Tensor, eps: float) -> None:
    if not isinstance(rewards_N, Tensor) or rewards_N.dim() != 1:
        raise ValueError(
            f"rewards_N must be a 1-D tensor of shape (N,), got "
            f"{getattr(rewards_N, 'shape', type(rewards_N))}; flatten (B, G) rewards with .reshape(-1)"
        )
    if not isinstance(group_ids_N, Tensor) or group_ids_N.shape != rewards_N.shape:
        raise ValueError(
            f"group_ids_N must be a tensor with the same shape as rewards_N {tuple(rewards_N.shape)}, "
            f"got {getattr(group_ids_N, 'shape', type(group_ids_N))}"
        )
    if group_ids_N.dtype.is_floating_point or group_ids_N.dtype.is_complex or group_ids_N.dtype == torch.bool:
        raise ValueError(f"group_ids_N must hold integer ids (e.g. torch.long), got dtype {group_ids_N.dtype}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards_N.numel() and not bool(torch.isfinite(rewards_N.double()).all()):
        raise ValueError("rewards_N contains NaN or inf; fix the reward function before computing advantages")


def _out_dtype(rewards_N: Tensor) -> torch.dtype:
    return rewards_N.dtype if rewards_N.dtype.is_floating_point else torch.float32


class _GroupStats:
    """Per-group count / mean / centred values, computed with index_add (no Python loop)."""

    def __init__(self, rewards_N: Tensor, group_ids_N: Tensor) -> None:
        r_N = rewards_N.to(torch.float64)
        _, inv_N = torch.unique(group_ids_N, return_inverse=True)
        n_groups = int(inv_N.max().item()) + 1 if inv_N.numel() else 0
        zeros_B = torch.zeros(n_groups, dtype=torch.float64, device=r_N.device)
        count_B = zeros_B.index_add(0, inv_N, torch.ones_like(r_N))
        mean_B = zeros_B.index_add(0, inv_N, r_N) / count_B.clamp(min=1.0)
        max_B = zeros_B.scatter_reduce(0, inv_N, r_N, reduce="amax", include_self=False)
        min_B = zeros_B.scatter_reduce(0, inv_N, r_N, reduce="amin", include_self=False)
        # sum/n of identical values is not always bit-identical to the value, so
        # all-equal groups are zeroed explicitly rather than trusted to cancel.
        equal_N = (max_B == min_B)[inv_N]
        centred_N = torch.where(equal_N, torch.zeros_like(r_N), r_N - mean_B[inv_N])
        sq_B = zeros_B.index_add(0, inv_N, centred_N * centred_N)
        self.inv_N = inv_N
        self.count_N = count_B[inv_N]
        self.centred_N = centred_N
        # Unbiased (n - 1) variance, as torch.std; undefined for n == 1, where we use 0.
        self.std_N = (sq_B / (count_B - 1.0).clamp(min=1.0)).sqrt()[inv_N]


def _batch_std(x_N: Tensor) -> Tensor:
    """Unbiased std over the whole batch (0 when N < 2)."""
    if x_N.numel() < 2:
        return torch.zeros((), dtype=x_N.dtype, device=x_N.device)
    return x_N.std()


def grpo_advantages(rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO advantage: A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

    std_g is the unbiased (n - 1) group std, as torch.std and verl use. A group
    of size 1 (or one whose rewards are all equal) gets advantage 0.
    Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), Sec. 4.1.2.

    Args:
        rewards_N: (N,) scalar reward per sequence.
        group_ids_N: (N,) integer prompt id of each sequence.
        eps: added to the std to avoid division by zero.
    Returns:
        adv_N: (N,) float tensor (rewards' float dtype, else float32).
    """
    _check_inputs(rewards_N, group_ids_N, eps)
    s = _GroupStats(rewards_N, group_ids_N)
    adv_N = torch.where(s.count_N > 1, s.centred_N / (s.std_N + eps), torch.zeros_like(s.centred_N))
    return adv_N.to(_out_dtype(rewards_N))


def drgrpo_advantages(rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO advantage: A_i = r_i - mean_g(r) (no std division).

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective" (arXiv:2503.20783), Sec. 3.1. eps is accepted for a uniform
    signature and unused. Shapes as grpo_advantages.
    """
    _check_inputs(rewards_N, group_ids_N, eps)
    return _GroupStats(rewards_N, group_ids_N).centred_N.to(_out_dtype(rewards_N))


def rloo_advantages(rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6) -> Tensor:
    """RLOO advantage: A_i = r_i - mean_{j != i in g}(r_j) = n/(n-1) * (r_i - mean_g(r)).

    A group of size 1 has no other sample and gets 0.
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs" (arXiv:2402.14740).
    eps is unused. Shapes as grpo_advantages.
    """
    _check_inputs(rewards_N, group_ids_N, eps)
    s = _GroupStats(rewards_N, group_ids_N)
    scale_N = s.count_N / (s.count_N - 1.0).clamp(min=1.0)
    adv_N = torch.where(s.count_N > 1, s.centred_N * scale_N, torch.zeros_like(s.centred_N))
    return adv_N.to(_out_dtype(rewards_N))


def reinforce_pp_advantages(rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ advantage: whiten over the whole batch, A_i = (r_i - mean(r)) / (std(r) + eps).

    std is the unbiased batch std; a batch of one sequence, or a batch whose
    rewards are all equal, gets 0. group_ids_N is only validated.
    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models" (arXiv:2501.03262). Shapes as grpo_advantages.
    """
    _check_inputs(rewards_N, group_ids_N, eps)
    r_N = rewards_N.to(torch.float64)
    if r_N.numel() == 0 or bool(r_N.max() == r_N.min()):
        return torch.zeros_like(r_N).to(_out_dtype(rewards_N))
    adv_N = (r_N - r_N.mean()) / (_batch_std(r_N) + eps)
    return adv_N.to(_out_dtype(rewards_N))


def reinforce_pp_baseline_advantages(rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: c_i = r_i - mean_g(r), then A_i = c_i / (std(c) + eps).

    std(c) is the unbiased std of the group-centred rewards over the whole
    batch. The batch mean of c is exactly 0, so this equals whitening c.
    Hu 2025, "REINFORCE++" (arXiv:2501.03262), "REINFORCE++-baseline".
    Shapes as grpo_advantages.
    """
    _check_inputs(rewards_N, group_ids_N, eps)
    c_N = _GroupStats(rewards_N, group_ids_N).centred_N
    return (c_N / (_batch_std(c_N) + eps)).to(_out_dtype(rewards_N))


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


def compute_advantages(name: str, rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6) -> Tensor:
    """Dispatch to ADVANTAGE_ESTIMATORS[name]; (N,), (N,) -> adv_N (N,)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name](rewards_N, group_ids_N, eps=eps)
