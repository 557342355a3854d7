"""Token rewards and their discounted returns over the valid tokens of a response (REINFORCE++).

The token-level estimator reinforce_pp (advantages.py) turns an outcome score
and an optional per-token KL into one reward per token, and those into returns
discounted over valid tokens only; whitening.py then normalises them. Split out
so the estimators module holds the estimators and their table.

Shape legend: N sequences, T response tokens; _N per sequence, _NT per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["token_rewards", "discounted_returns", "check_token_kl"]


def token_rewards(scores_N: Tensor, valid_NT: Tensor, kl_NT: Tensor | None, kl_coef: float) -> Tensor:
    """Token rewards (float64): -kl_coef * kl on valid tokens, plus the score on each row's last valid token."""
    T = valid_NT.shape[1]
    idx_T = torch.arange(T, device=valid_NT.device)
    # Last valid position per row (-1 for an empty row, which then gets no score).
    last_N = torch.where(valid_NT, idx_T, -1).amax(dim=1) if T else torch.full_like(scores_N, -1, dtype=torch.long)
    at_end_NT = valid_NT & (idx_T == last_N[:, None])
    zero = torch.zeros((), dtype=torch.float64, device=valid_NT.device)
    r_NT = torch.where(at_end_NT, scores_N.detach().to(torch.float64)[:, None], zero)
    if kl_NT is not None:
        r_NT = r_NT - kl_coef * torch.where(valid_NT, kl_NT.detach().to(torch.float64), zero)
    return r_NT


def discounted_returns(r_NT: Tensor, valid_NT: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{s >= t valid} gamma^(number of valid tokens in [t, s)) r_s on valid tokens, 0 elsewhere.

    Solves the backward recursion H_t = r_t + a_t H_{t+1}, with a_t = gamma on
    valid tokens and 1 on padding (padding neither adds nor discounts), by a
    log-depth scan: after the pass with offset k each position holds (a_t, b_t)
    with H_t = b_t + a_t H_{t+k}, and H beyond the end is 0. That is log2(T)
    passes of (N, T) work instead of a T-step Python loop of small kernels.
    """
    T = r_NT.shape[1]
    zero = torch.zeros((), dtype=r_NT.dtype, device=r_NT.device)
    b_NT = torch.where(valid_NT, r_NT, zero)
    a_NT = torch.where(valid_NT, torch.full_like(r_NT, gamma), torch.ones_like(r_NT))
    k = 1
    while k < T:
        # (a, b) at t + k, zero past the end; b first, as it needs the old a.
        b_NT = b_NT + a_NT * F.pad(b_NT[:, k:], (0, k))
        a_NT = a_NT * F.pad(a_NT[:, k:], (0, k))
        k *= 2
    return torch.where(valid_NT, b_NT, zero)


def check_token_kl(kl_NT: Tensor | None, kl_coef: float, mask_NT: Tensor) -> None:
    """A per-token KL reward's inputs: both or neither, (N, T) like mask_NT, float, finite on valid tokens."""
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_NT is None:
        if kl_coef != 0:
            raise ValueError(f"kl_coef={kl_coef} needs kl_NT, the (N, T) per-token KL estimate; pass both or neither")
        return
    if not isinstance(kl_NT, Tensor) or kl_NT.shape != mask_NT.shape:
        raise ValueError(
            f"kl_NT must have the (N, T) shape of mask_NT {tuple(mask_NT.shape)}, got "
            f"{getattr(kl_NT, 'shape', type(kl_NT))}; compute it on the response tokens (kl_estimate)"
        )
    if not kl_NT.dtype.is_floating_point:
        raise ValueError(f"kl_NT must be a float tensor, got dtype {kl_NT.dtype}")
    valid_NT = mask_NT.to(kl_NT.device) != 0
    if not bool(torch.isfinite(torch.where(valid_NT, kl_NT.detach(), torch.zeros_like(kl_NT))).all()):
        raise ValueError("kl_NT has NaN or inf on valid tokens; check the log-probs of the policy and the reference")
