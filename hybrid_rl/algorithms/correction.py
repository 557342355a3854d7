"""Rollout-vs-trainer mismatch correction (truncated / masked importance sampling).

Shape legend:
    N   sequences, T response tokens (padded)
    _NT per-token tensor, _N per-sequence tensor

The inference engine that sampled the rollouts (e.g. SGLang with its own
kernels / precision) does not compute exactly the probabilities the trainer
computes for the same weights. The rollouts are therefore slightly off-policy
with respect to the trainer's pi_old, with importance ratio
    rho_t = pi_old(y_t) / pi_engine(y_t) = exp(old_logp_t - engine_logp_t)
or, at sequence level, rho_i = exp(sum_t m_it (old_logp_it - engine_logp_it)).
Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training" (fengyao.notion.site/off-policy-rl), propose truncated IS (TIS);
masked IS (MIS) drops tokens / sequences whose ratio is out of range instead.

Modes:
    none       weight 1, mask unchanged
    tis_token  weight_t = min(rho_t, cap)             (also >= lower if lower given)
    tis_seq    weight_t = min(rho_i, cap) on every token of sequence i
    mis_token  mask out tokens with rho_t outside [lower, cap]; weight 1
    mis_seq    mask out whole sequences with rho_i outside [lower, cap]; weight 1
lower defaults to 1 / cap for MIS and to "no lower bound" for TIS.

Conventions: weight_NT is detached and equals 1.0 wherever the returned mask is
0 (padding, masked tokens), so the returned mask must always be used to exclude
tokens; multiply the per-token loss by weight_NT. Ratios are compared in log
space, so no exp can overflow.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["CORRECTION_MODES", "rollout_correction"]

CORRECTION_MODES = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq")
# Only used to keep the logged max ratio finite.
_LOG_RATIO_LOG_CLAMP = 20.0


def _check(old_logp_NT: Tensor, engine_logp_NT: Tensor, mask_NT: Tensor) -> None:
    if not isinstance(old_logp_NT, Tensor) or old_logp_NT.dim() != 2:
        raise ValueError(f"old_logp_NT must be a 2-D (N, T) tensor, got {getattr(old_logp_NT, 'shape', None)}")
    shape = tuple(old_logp_NT.shape)
    for what, t in (("engine_logp_NT", engine_logp_NT), ("mask_NT", mask_NT)):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            raise ValueError(
                f"{what} must have the shape of old_logp_NT {shape}, got {getattr(t, 'shape', None)}; "
                "align engine log-probs to the response tokens first"
            )


def _token_log_ratio(old_logp_NT: Tensor, engine_logp_NT: Tensor, valid_NT: Tensor) -> Tensor:
    dtype = torch.promote_types(old_logp_NT.dtype, torch.float32)
    d_NT = old_logp_NT.detach().to(dtype) - engine_logp_NT.detach().to(dtype)
    return torch.where(valid_NT, d_NT, torch.zeros((), dtype=dtype, device=d_NT.device))


def rollout_correction(
    old_logp_NT: Tensor,
    engine_logp_NT: Tensor,
    mask_NT: Tensor,
    mode: str,
    cap: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Importance weights and mask correcting for the engine/trainer mismatch.

    Args:
        old_logp_NT: (N, T) trainer log-probs of the sampled tokens (pi_old).
        engine_logp_NT: (N, T) log-probs the rollout engine reported.
        mask_NT: (N, T) response mask (bool or 0/1).
        mode: one of CORRECTION_MODES (see module docstring for formulas).
        cap: upper bound C > 0 on rho (TIS truncation / MIS acceptance).
        lower: lower bound on rho; MIS default 1 / cap, TIS default none.
    Returns:
        weight_NT: (N, T) detached float weights (1.0 where the returned mask is 0).
        mask_NT: (N, T) mask, same dtype as the input, with MIS rejections zeroed.
        metrics: 0-d float32 tensors over the input's valid tokens:
            mismatch_abs_logp_mean   mean |old - engine|
            mismatch_k3_mean         mean k3 estimate of KL(pi_engine || pi_old)
            mismatch_ratio_max       max rho at the mode's granularity (token for
                                     none / *_token, sequence for *_seq), exp of a
                                     log-ratio clamped at 20
            mismatch_seq_log_ratio_abs_max   max |log rho_i| over non-empty rows
            mismatch_frac_masked     fraction of valid tokens MIS masked out
            mismatch_frac_capped     fraction of valid tokens whose TIS weight
                                     was truncated (at cap or lower)
    """
    log_cap, log_lower = _checked_log_bounds(old_logp_NT, engine_logp_NT, mask_NT, mode, cap, lower)
    is_seq = mode.endswith("_seq")
    valid_NT = mask_NT != 0
    d_NT = _token_log_ratio(old_logp_NT, engine_logp_NT, valid_NT)
    seq_d_N = d_NT.sum(dim=1)
    # The log-ratio that decides, per token: the token's own or its sequence's.
    dec_NT = seq_d_N[:, None].expand_as(d_NT) if is_seq else d_NT
    weight_NT, out_valid_NT, capped_NT, masked_NT = _correct(mode, d_NT, dec_NT, valid_NT, log_cap, log_lower)
    metrics = _mismatch_metrics(d_NT, seq_d_N, valid_NT, is_seq, capped_NT, masked_NT)
    return weight_NT, out_valid_NT.to(mask_NT.dtype), metrics


def _checked_log_bounds(
    old_logp_NT: Tensor, engine_logp_NT: Tensor, mask_NT: Tensor, mode: str, cap: float, lower: float | None
) -> tuple[float, float | None]:
    """Checks the arguments; returns (log cap, log lower bound), the lower bound defaulting to
    1 / cap for MIS and to None (no lower bound) for TIS and none."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r}; valid modes: {list(CORRECTION_MODES)}")
    _check(old_logp_NT, engine_logp_NT, mask_NT)
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if lower is not None and not 0 < lower < cap:
        raise ValueError(f"lower must satisfy 0 < lower < cap = {cap}, got {lower}")
    if lower is None and mode.startswith("mis"):
        lower = 1.0 / cap
    return math.log(cap), None if lower is None else math.log(lower)


def _correct(
    mode: str, d_NT: Tensor, dec_NT: Tensor, valid_NT: Tensor, log_cap: float, log_lower: float | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The mode's weights and mask from the deciding log-ratio dec_NT (per token, or its sequence's).

    TIS: weight = exp(clamp(dec, log lower, log cap)) on valid tokens; MIS: valid tokens whose
    dec lies outside [log lower, log cap] are masked out; none: neither.
    Returns weight_NT (1.0 off the valid tokens), the valid mask after MIS, and the boolean
    (N, T) masks of the tokens TIS truncated and MIS masked out (for the metrics).
    """
    weight_NT = torch.ones_like(d_NT)
    out_valid_NT = valid_NT
    above_NT = valid_NT & (dec_NT > log_cap)
    below_NT = valid_NT & (dec_NT < log_lower) if log_lower is not None else torch.zeros_like(valid_NT)
    capped_NT = torch.zeros_like(valid_NT)
    masked_NT = torch.zeros_like(valid_NT)
    if mode.startswith("tis"):
        w_NT = torch.exp(dec_NT.clamp(min=log_lower, max=log_cap))
        weight_NT = torch.where(valid_NT, w_NT, weight_NT)
        capped_NT = above_NT | below_NT
    elif mode.startswith("mis"):
        masked_NT = above_NT | below_NT
        out_valid_NT = valid_NT & ~masked_NT
    return weight_NT, out_valid_NT, capped_NT, masked_NT


def _mismatch_metrics(
    d_NT: Tensor, seq_d_N: Tensor, valid_NT: Tensor, is_seq: bool, capped_NT: Tensor, masked_NT: Tensor
) -> dict[str, Tensor]:
    """The `rollout_correction` metrics (its docstring), from the token log-ratios d_NT (0 off
    the valid tokens), their per-sequence sums seq_d_N, and the TIS-truncated / MIS-masked tokens."""
    n_tok = valid_NT.sum().clamp(min=1)
    zero_f = torch.zeros((), dtype=torch.float32, device=d_NT.device)
    if bool(valid_NT.any()):
        ratio_log_max = (seq_d_N[valid_NT.any(dim=1)] if is_seq else d_NT[valid_NT]).max()
        ratio_max = torch.exp(ratio_log_max.clamp(max=_LOG_RATIO_LOG_CLAMP)).float()
        seq_abs_max = seq_d_N[valid_NT.any(dim=1)].abs().max().float()
    else:
        ratio_max, seq_abs_max = zero_f + 1.0, zero_f
    # k3 for KL(engine || old) with samples from the engine: rho - 1 - log rho.
    k3_NT = torch.expm1(d_NT.clamp(max=_LOG_RATIO_LOG_CLAMP)) - d_NT
    return {
        "mismatch_abs_logp_mean": (d_NT.abs().sum() / n_tok).float(),
        "mismatch_k3_mean": (torch.where(valid_NT, k3_NT, torch.zeros_like(k3_NT)).sum() / n_tok).float(),
        "mismatch_ratio_max": ratio_max,
        "mismatch_seq_log_ratio_abs_max": seq_abs_max,
        "mismatch_frac_masked": (masked_NT.sum() / n_tok).float(),
        "mismatch_frac_capped": (capped_NT.sum() / n_tok).float(),
    }
