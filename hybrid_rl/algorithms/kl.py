"""KL estimators, KL-coefficient controllers and the reward-side KL penalty.

Shape legend:
    N   sequences, T response tokens
    _NT per-token tensor, _N per-sequence tensor

Per-token KL estimators of KL(pi || pi_ref) from samples y_t ~ pi, with
log-ratio d_t = logp_t - ref_logp_t (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html):
    k1 = d                          unbiased, high variance, can be negative
    k2 = d^2 / 2                    biased, low variance
    k3 = exp(-d) - (-d) - 1 >= 0    unbiased, low variance ("low_var_kl")
k3 is clamped to [-10, 10] as verl does, so one wild token cannot dominate.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "kl_estimate",
    "FixedKLController",
    "AdaptiveKLController",
    "kl_penalty_rewards",
]

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
_K3_CLAMP = 10.0


def kl_estimate(logp_NT: Tensor, ref_logp_NT: Tensor, kind: str, *, mask_NT: Tensor | None = None) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate, kl_NT (same shape as the inputs).

    kind: "k1" (logp - ref), "k2" (0.5 * (logp - ref)^2), "k3" or its alias
    "low_var_kl" (exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]).
    Gradients flow into both inputs; detach ref_logp_NT yourself if needed.
    If mask_NT is given the result is 0 where mask_NT == 0 (and garbage such as
    -inf log-probs at padded positions cannot produce NaN there).
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid names: {list(KL_ESTIMATORS)}")
    if not isinstance(logp_NT, Tensor) or not isinstance(ref_logp_NT, Tensor) or logp_NT.shape != ref_logp_NT.shape:
        raise ValueError(
            f"logp_NT and ref_logp_NT must be tensors of the same shape, got "
            f"{getattr(logp_NT, 'shape', None)} and {getattr(ref_logp_NT, 'shape', None)}"
        )
    d_NT = logp_NT - ref_logp_NT
    if mask_NT is not None:
        if mask_NT.shape != logp_NT.shape:
            raise ValueError(f"mask_NT must have shape {tuple(logp_NT.shape)}, got {tuple(mask_NT.shape)}")
        d_NT = torch.where(mask_NT != 0, d_NT, torch.zeros_like(d_NT))
    if kind == "k1":
        return d_NT
    if kind == "k2":
        return 0.5 * d_NT.square()
    # k3: with r = pi_ref / pi = exp(-d), (r - 1) - log r is >= 0 and unbiased.
    # x -> exp(x) - x - 1 is increasing for x > 0 and already > 10 at x = 20, so
    # clamping x there avoids inf/NaN without changing any clamped value.
    x_NT = (-d_NT).clamp(max=2.0 * _K3_CLAMP)
    k3_NT = torch.exp(x_NT) - x_NT - 1.0
    return k3_NT.clamp(min=-_K3_CLAMP, max=_K3_CLAMP)


class FixedKLController:
    """Constant KL coefficient; update() is a no-op kept for a uniform interface."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Ignore the measurement; the coefficient stays fixed."""


class AdaptiveKLController:
    """Proportional KL controller (Ziegler et al. 2019, arXiv:1909.08593, Sec. 2.2).

    e     = clip(current_kl / target_kl - 1, -0.2, 0.2)
    coef <- coef * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: int) -> None:
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 (in samples/steps), got {horizon}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient towards target_kl; n_steps is the number of samples (or steps) since last update."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * float(n_steps) / self.horizon


def kl_penalty_rewards(rewards_N: Tensor, kl_NT: Tensor, mask_NT: Tensor, coef: float) -> Tensor:
    """Put the KL penalty in the reward: r_i - coef * sum_t m_it * kl_it.

    Used when KL is part of the reward (InstructGPT-style, Ouyang et al. 2022)
    rather than a loss term. kl_NT is detached: rewards are not differentiated.

    Args:
        rewards_N: (N,) sequence rewards.
        kl_NT: (N, T) per-token KL estimate (see kl_estimate).
        mask_NT: (N, T) response mask; masked positions are ignored.
        coef: KL coefficient (e.g. controller.value).
    Returns:
        rewards_N: (N,) penalised rewards, float.
    """
    if not isinstance(kl_NT, Tensor) or kl_NT.dim() != 2 or kl_NT.shape != mask_NT.shape:
        raise ValueError(
            f"kl_NT and mask_NT must both be (N, T), got {getattr(kl_NT, 'shape', None)} "
            f"and {getattr(mask_NT, 'shape', None)}"
        )
    if rewards_N.shape != kl_NT.shape[:1]:
        raise ValueError(f"rewards_N must have shape ({kl_NT.shape[0]},) to match kl_NT, got {tuple(rewards_N.shape)}")
    kl_NT = kl_NT.detach()
    kl_sum_N = torch.where(mask_NT != 0, kl_NT, torch.zeros_like(kl_NT)).sum(dim=1)
    out_dtype = torch.promote_types(kl_sum_N.dtype, rewards_N.dtype)
    if not out_dtype.is_floating_point:
        out_dtype = torch.float32
    return rewards_N.to(out_dtype) - coef * kl_sum_N.to(out_dtype)
