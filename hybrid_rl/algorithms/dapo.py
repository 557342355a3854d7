"""DAPO helpers: dynamic-sampling group filter, soft overlong penalty, overlong filtering.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale" (arXiv:2503.14476).

Shape legend:
    N   sequences (B prompts x G samples), T response tokens (padded)
    _NT per-token tensor, _N per-sequence tensor
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["filter_groups", "overlong_penalty", "truncation_mask"]


def filter_groups(rewards_N: Tensor, group_ids_N: Tensor) -> Tensor:
    """Dynamic sampling (DAPO Sec. 3.2): keep only groups whose rewards differ.

    A group whose rewards are all exactly equal (zero std: all correct or all
    wrong) has zero GRPO advantage and contributes no gradient, so every member
    gets keep = False. A group of size 1 is trivially all-equal and is dropped.

    Args:
        rewards_N: (N,) sequence rewards.
        group_ids_N: (N,) integer prompt ids (any values, any order).
    Returns:
        keep_N: (N,) bool.
    """
    if not isinstance(rewards_N, Tensor) or rewards_N.dim() != 1:
        raise ValueError(f"rewards_N must be a 1-D (N,) tensor, got {getattr(rewards_N, 'shape', None)}")
    if not isinstance(group_ids_N, Tensor) or group_ids_N.shape != rewards_N.shape:
        raise ValueError(
            f"group_ids_N must have the shape of rewards_N {tuple(rewards_N.shape)}, "
            f"got {getattr(group_ids_N, 'shape', None)}"
        )
    if group_ids_N.dtype.is_floating_point or group_ids_N.dtype == torch.bool:
        raise ValueError(f"group_ids_N must hold integer ids, got dtype {group_ids_N.dtype}")
    if rewards_N.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards_N.device)
    r_N = rewards_N.to(torch.float64)
    _, inv_N = torch.unique(group_ids_N, return_inverse=True)
    n_groups = int(inv_N.max().item()) + 1
    init_B = torch.zeros(n_groups, dtype=torch.float64, device=r_N.device)
    max_B = init_B.scatter_reduce(0, inv_N, r_N, reduce="amax", include_self=False)
    min_B = init_B.scatter_reduce(0, inv_N, r_N, reduce="amin", include_self=False)
    return (max_B != min_B)[inv_N]


def overlong_penalty(lengths_N: Tensor, max_new_tokens: int, buffer_len: int, penalty_factor: float) -> Tensor:
    """Soft overlong punishment (DAPO Sec. 3.4, Eq. 13), added to the reward.

    With L = max_new_tokens, C = buffer_len, f = penalty_factor, len = |y|:
        0                         if len <= L - C
        f * ((L - C) - len) / C   if L - C < len <= L   (linear, reaches -f at L)
        -f                        if len > L
    buffer_len = 0 gives a hard step: 0 up to L, -f beyond.

    Args:
        lengths_N: (N,) response lengths in tokens.
    Returns:
        penalty_N: (N,) float32, values in [-penalty_factor, 0].
    """
    if not isinstance(lengths_N, Tensor) or lengths_N.dim() != 1:
        raise ValueError(f"lengths_N must be a 1-D (N,) tensor, got {getattr(lengths_N, 'shape', None)}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if not 0 <= buffer_len <= max_new_tokens:
        raise ValueError(f"buffer_len must be in [0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0 (the penalty is subtracted), got {penalty_factor}")
    length_N = lengths_N.to(torch.float64)
    expected = float(max_new_tokens - buffer_len)
    if buffer_len > 0:
        ramp_N = (expected - length_N) / buffer_len * penalty_factor
    else:
        ramp_N = torch.zeros_like(length_N)
    penalty_N = torch.where(length_N <= expected, torch.zeros_like(length_N), ramp_N)
    penalty_N = torch.where(length_N > max_new_tokens, torch.full_like(length_N, -penalty_factor), penalty_N)
    return penalty_N.to(torch.float32)


def truncation_mask(finish_truncated_N: Tensor, mask_NT: Tensor) -> Tensor:
    """Overlong filtering (DAPO Sec. 3.4): drop truncated completions from the loss.

    Args:
        finish_truncated_N: (N,) bool, True where generation hit the length limit.
        mask_NT: (N, T) response mask (bool or 0/1).
    Returns:
        mask_NT: (N, T), same dtype as the input, all-zero rows for truncated samples.
    """
    if not isinstance(mask_NT, Tensor) or mask_NT.dim() != 2:
        raise ValueError(f"mask_NT must be a 2-D (N, T) tensor, got {getattr(mask_NT, 'shape', None)}")
    if not isinstance(finish_truncated_N, Tensor) or finish_truncated_N.shape != mask_NT.shape[:1]:
        raise ValueError(
            f"finish_truncated_N must be a (N,) = ({mask_NT.shape[0]},) tensor, "
            f"got {getattr(finish_truncated_N, 'shape', None)}"
        )
    keep_N = finish_truncated_N == 0
    return torch.where(keep_N[:, None], mask_NT, torch.zeros_like(mask_NT))
