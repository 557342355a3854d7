"""Whitening over the valid tokens of a data-parallel batch: (x - mean) / (std + eps).

The token-level advantage estimators (REINFORCE++ and its baseline variant,
advantages.py) whiten over every valid token of the GLOBAL batch, so the
statistics are summed over ranks with one reduce_sum call. Kept apart from the
estimators because the exactness rules below (all-equal values give exactly 0,
on one rank or many) are about the statistics, not about any estimator.

Shape legend: N sequences, T response tokens; _NT one entry per token.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["ReduceSum", "N_STATS", "local_moments", "whiten_valid", "stats_mask"]

# A callable that all-reduce-sums a float64 tensor over the data-parallel ranks and returns it.
ReduceSum = Callable[[Tensor], Tensor]
N_STATS = 5
_EPS64 = torch.finfo(torch.float64).eps


def local_moments(x_NT: Tensor, valid_NT: Tensor) -> Tensor:
    """This rank's whitening statistics, float64 (5,); each entry sums over ranks to the global one.

    [n_r, n_r m_r, sum_valid (x - m_r)^2, n_r m_r^2, 1] with n_r the number of
    valid tokens and m_r their mean. Deviations are taken about the local mean,
    not accumulated as a raw sum of squares, so the within-rank spread has no
    cancellation. A rank whose values are all equal uses that value as m_r, so
    its squared deviations are exactly 0.
    """
    f64 = dict(dtype=torch.float64, device=x_NT.device)
    if x_NT.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0], **f64)
    zero = torch.zeros((), **f64)
    inf = torch.full((), float("inf"), **f64)
    x_NT = torch.where(valid_NT, x_NT, zero)
    n = valid_NT.sum().to(torch.float64)
    hi = torch.where(valid_NT, x_NT, -inf).amax()
    lo = torch.where(valid_NT, x_NT, inf).amin()
    mean = torch.where(hi == lo, hi, x_NT.sum() / n.clamp(min=1.0))
    mean = torch.where(n > 0, mean, zero)
    dev_NT = torch.where(valid_NT, x_NT - mean, zero)
    return torch.stack([n, n * mean, (dev_NT * dev_NT).sum(), n * mean * mean, torch.ones((), **f64)])


def whiten_valid(
    x_NT: Tensor, valid_NT: Tensor, eps: float, reduce_sum: ReduceSum | None, stats_NT: Tensor | None = None
) -> Tensor:
    """(x - mean) / (std + eps) over the valid tokens of every rank, float64; 0 at masked positions.
    stats_NT: the tokens mean and std are taken over (default: valid_NT), e.g. only those the loss trains.

    One reduce_sum call on the 5 statistics of local_moments. The variance is
    within-rank squared deviations plus the between-rank part
    sum_r n_r m_r^2 - n mean^2. The latter is a difference of two nearly equal
    sums, so values within its rounding bound ((4 R + 8) eps64 sum_r n_r m_r^2
    for R ranks) are treated as 0: then one rank's result does not depend on
    round-off, and a batch whose values are all equal (on one rank or many)
    gets a variance of exactly 0 and an advantage of exactly 0.
    std is unbiased (divides by n - 1), as verl's masked_whiten; n < 2 gives 0.
    """
    stats = local_moments(x_NT, valid_NT if stats_NT is None else stats_NT)
    if reduce_sum is not None:
        # Every rank must reach this call, also with an empty local batch.
        stats = reduce_sum(stats)
        if not isinstance(stats, Tensor) or stats.shape != (N_STATS,):
            raise ValueError(
                f"reduce_sum must return the summed float64 ({N_STATS},) tensor it was given, got "
                f"{getattr(stats, 'shape', type(stats))}; pass e.g. hybrid_rl.runtime.distributed.all_reduce_sum"
            )
    n, total, m2_within, sq_means, ranks = stats.to(torch.float64).unbind()
    mean = total / n.clamp(min=1.0)
    between = sq_means - total * mean
    between = torch.where(between > (4.0 * ranks + 8.0) * _EPS64 * sq_means, between, torch.zeros_like(between))
    m2 = m2_within + between
    spread = (m2 > 0) & (n > 1)
    std = (m2 / (n - 1.0).clamp(min=1.0)).sqrt()
    denom = torch.where(spread, std + eps, torch.ones_like(std))
    zero = torch.zeros((), dtype=torch.float64, device=x_NT.device)
    return torch.where(valid_NT & spread, (x_NT.to(torch.float64) - mean) / denom, zero)


def stats_mask(stats_mask_NT: Tensor | None, mask_NT: Tensor) -> Tensor | None:
    """The whitening tokens as a bool mask within mask_NT, or None (= mask_NT)."""
    if stats_mask_NT is None:
        return None
    if not isinstance(stats_mask_NT, Tensor) or stats_mask_NT.shape != mask_NT.shape:
        raise ValueError(
            f"stats_mask_NT must have the (N, T) shape of mask_NT {tuple(mask_NT.shape)}, got "
            f"{getattr(stats_mask_NT, 'shape', type(stats_mask_NT))}"
        )
    return (stats_mask_NT.to(mask_NT.device) != 0) & (mask_NT != 0)
