"""Per-token policy-gradient losses: PPO-clip (with dual clip), GSPO and CISPO.

Shape legend:
    N   sequences (B prompts x G samples), T response tokens (padded)
    _NT per-token tensor, _N per-sequence tensor

Every loss has the signature
    fn(logp_NT, old_logp_NT, adv, mask_NT, *, clip_ratio_low=..., clip_ratio_high=...,
       clip_ratio_c=None, weight_NT=None) -> (loss_NT, metrics)
loss_NT is the per-token loss to MINIMISE, 0 where mask_NT == 0 and NOT
aggregated: reduce it with aggregation.aggregate_loss. adv is (N,) (broadcast
over tokens) or (N, T). old_logp_NT, adv and weight_NT are treated as
constants (detached); gradients flow only through logp_NT.

Numerics: work is done in float32 (float64 if logp is float64). Values at
masked positions are replaced by 0 before any arithmetic, so padding that
holds -inf or NaN cannot leak NaN into values or gradients. log-ratios are
clamped to [-20, 20] before exp (as verl does), which only matters for
ratios beyond e^20.

A clip bound of None disables that side. Metrics (0-d float32 tensors,
masked means over valid tokens; with no valid token the fractions and
approx_kl are 0 and the ratio statistics 1.0):
    clip_frac_low / clip_frac_high / clip_frac: fraction of valid tokens where
        the lower / upper / either bound is active (see each loss for "active");
    approx_kl: mean k3 estimate of KL(pi_old || pi), exp(d) - 1 - d with
        d = logp - old_logp (>= 0; Schulman 2020);
    ratio_mean / ratio_max / ratio_min: the importance ratio each loss uses;
    dual_clip_frac (ppo_clip only): fraction where the dual clip is active.

Metric names vs verl (verl/trainer/ppo/core_algos.py, compute_policy_loss_*,
logged as actor/<name>; checked against verl at commit b178a3c, Jan 2026):
    ours             verl                relation
    clip_frac        pg_clipfrac         same quantity: valid tokens where the clipped
                                         term wins, verl's (pg_losses2 > pg_losses1),
                                         i.e. A > 0 and ratio > 1 + high, or A < 0 and
                                         ratio < 1 - low; for cispo both count
                                         ratio != clip(ratio) whatever the sign of A
    clip_frac_low,   -                   the two parts of clip_frac
    clip_frac_high
    dual_clip_frac   pg_clipfrac_lower   same quantity: A < 0 and the clipped loss
                                         exceeds -A * clip_ratio_c. Despite its name
                                         verl's metric counts dual-clip activations,
                                         not the lower ratio bound; it is 0 here
                                         unless clip_ratio_c is set (verl: 3.0)
    approx_kl        ppo_kl              same target, different estimator: both
                                         estimate KL(pi_old || pi) from the sampled
                                         tokens with d = logp - old_logp; verl logs
                                         k1 = mean(-d) (unbiased, can be < 0), we log
                                         k3 = mean(exp(d) - 1 - d) (unbiased, >= 0).
                                         They agree in expectation, not per batch.
    ratio_*          -                   not logged by verl's policy losses
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["POLICY_LOSSES", "compute_policy_loss", "ppo_clip_loss", "gspo_loss", "cispo_loss"]

_LOG_RATIO_CLAMP = 20.0


def _prepare(logp_NT, old_logp_NT, adv, mask_NT, weight_NT, low, high, name):
    """Validate shapes/bounds; return sanitised (logp, old, adv_NT, valid, weight) in the work dtype."""
    if not isinstance(logp_NT, Tensor) or logp_NT.dim() != 2:
        raise ValueError(f"{name}: logp_NT must be a 2-D (N, T) tensor, got {getattr(logp_NT, 'shape', None)}")
    shape = tuple(logp_NT.shape)
    for what, t in (("old_logp_NT", old_logp_NT), ("mask_NT", mask_NT)):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            raise ValueError(f"{name}: {what} must have the shape of logp_NT {shape}, got {getattr(t, 'shape', None)}")
    if not isinstance(adv, Tensor) or tuple(adv.shape) not in (shape[:1], shape):
        raise ValueError(
            f"{name}: advantages must be (N,) = {shape[:1]} or (N, T) = {shape}, got {getattr(adv, 'shape', None)}"
        )
    if weight_NT is not None and (not isinstance(weight_NT, Tensor) or tuple(weight_NT.shape) != shape):
        raise ValueError(
            f"{name}: weight_NT must have the shape of logp_NT {shape}, got {getattr(weight_NT, 'shape', None)}"
        )
    for what, v in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if v is not None and v < 0:
            raise ValueError(f"{name}: {what} must be >= 0 or None (disabled), got {v}")
    dtype = torch.promote_types(logp_NT.dtype, torch.float32)
    valid_NT = mask_NT != 0
    zero = torch.zeros((), dtype=dtype, device=logp_NT.device)
    logp = torch.where(valid_NT, logp_NT.to(dtype), zero)
    old = torch.where(valid_NT, old_logp_NT.detach().to(dtype), zero)
    adv_NT = adv.detach().to(dtype)
    if adv_NT.dim() == 1:
        adv_NT = adv_NT[:, None].expand(shape)
    adv_NT = torch.where(valid_NT, adv_NT, zero)
    w = None if weight_NT is None else torch.where(valid_NT, weight_NT.detach().to(dtype), zero)
    return logp, old, adv_NT, valid_NT, w, zero


def _bounds(low: float | None, high: float | None) -> tuple[float | None, float | None]:
    return (None if low is None else 1.0 - low), (None if high is None else 1.0 + high)


def _clip(x: Tensor, lo: float | None, hi: float | None) -> Tensor:
    return x if lo is None and hi is None else x.clamp(min=lo, max=hi)


def _frac(flag_NT: Tensor, valid_NT: Tensor) -> Tensor:
    n = valid_NT.sum().clamp(min=1)
    return ((flag_NT & valid_NT).sum() / n).float().detach()


def _metrics(ratio_NT, d_NT, valid_NT, low_NT, high_NT) -> dict[str, Tensor]:
    """Shared metrics; ratio_NT is the ratio the loss uses, d_NT = logp - old (clamped)."""
    n = valid_NT.sum().clamp(min=1)
    r = ratio_NT.detach()
    d = d_NT.detach()
    k3_NT = torch.where(valid_NT, torch.expm1(d) - d, torch.zeros_like(d))
    # max/min via +-inf fill instead of boolean indexing: no host-device sync.
    inf = torch.full((), float("inf"), dtype=r.dtype, device=r.device)
    r_max = torch.where(valid_NT, r, -inf).max() if r.numel() else -inf
    r_min = torch.where(valid_NT, r, inf).min() if r.numel() else inf
    one = torch.ones((), dtype=r.dtype, device=r.device)
    return {
        "clip_frac_low": _frac(low_NT, valid_NT),
        "clip_frac_high": _frac(high_NT, valid_NT),
        "clip_frac": _frac(low_NT | high_NT, valid_NT),
        "approx_kl": (k3_NT.sum() / n).float(),
        "ratio_mean": torch.where(valid_NT.any(), torch.where(valid_NT, r, torch.zeros_like(r)).sum() / n, one).float(),
        "ratio_max": torch.where(torch.isfinite(r_max), r_max, one).float(),
        "ratio_min": torch.where(torch.isfinite(r_min), r_min, one).float(),
    }


def _finish(pg_NT: Tensor, valid_NT: Tensor, w: Tensor | None, zero: Tensor) -> Tensor:
    if w is not None:
        pg_NT = pg_NT * w
    return torch.where(valid_NT, pg_NT, zero)


def ppo_clip_loss(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv: Tensor,
    mask_NT: Tensor,
    *,
    clip_ratio_low: float | None = 0.2,
    clip_ratio_high: float | None = 0.2,
    clip_ratio_c: float | None = None,
    weight_NT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017, arXiv:1707.06347).

        rho_t = exp(logp_t - old_t)
        l_t   = max(-A_t rho_t, -A_t clip(rho_t, 1 - low, 1 + high))
    Asymmetric bounds are DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476).
    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with
    Deep RL", arXiv:1912.09729) when clip_ratio_c > 1: for A_t < 0,
    l_t = min(l_t, -A_t c), bounding the loss of very off-policy tokens.
    The dual clip is OFF by default (clip_ratio_c=None); verl's default is
    clip_ratio_c=3.0, i.e. on. Pass clip_ratio_c=3.0 to match verl.
    Active bounds: upper when A > 0 and rho > 1 + high; lower when A < 0 and
    rho < 1 - low; dual when A < 0 and the unclipped-by-c loss exceeds -A c.
    weight_NT (optional, detached) multiplies the per-token loss, e.g. the
    rollout-correction weight. Shapes: see module docstring.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"ppo_clip: clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    logp, old, adv_NT, valid, w, zero = _prepare(
        logp_NT, old_logp_NT, adv, mask_NT, weight_NT, clip_ratio_low, clip_ratio_high, "ppo_clip"
    )
    lo, hi = _bounds(clip_ratio_low, clip_ratio_high)
    d_NT = (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio_NT = torch.exp(d_NT)
    pg_NT = torch.maximum(-adv_NT * ratio_NT, -adv_NT * _clip(ratio_NT, lo, hi))
    high_NT = (adv_NT > 0) & (ratio_NT > hi) if hi is not None else torch.zeros_like(valid)
    low_NT = (adv_NT < 0) & (ratio_NT < lo) if lo is not None else torch.zeros_like(valid)
    dual_NT = torch.zeros_like(valid)
    if clip_ratio_c is not None:
        cap_NT = -adv_NT * clip_ratio_c
        dual_NT = (adv_NT < 0) & (pg_NT > cap_NT)
        pg_NT = torch.where(adv_NT < 0, torch.minimum(pg_NT, cap_NT), pg_NT)
    metrics = _metrics(ratio_NT, d_NT, valid, low_NT, high_NT)
    metrics["dual_clip_frac"] = _frac(dual_NT, valid)
    return _finish(pg_NT, valid, w, zero), metrics


def gspo_loss(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv: Tensor,
    mask_NT: Tensor,
    *,
    clip_ratio_low: float | None = 0.2,
    clip_ratio_high: float | None = 0.2,
    clip_ratio_c: float | None = None,
    weight_NT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO per-token loss (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

        s_i    = exp( (1/|y_i|) sum_t m_it (logp_it - old_it) )       sequence ratio
        s_it   = sg[s_i] * exp(logp_it - sg[logp_it])                  (value exactly s_i)
        l_it   = max(-A_it s_it, -A_it clip(s_it, 1 - low, 1 + high))
    The token form (paper Eq. for GSPO-token) has the value of s_i and gradient
    s_i * grad logp_it, so seq-mean-token-mean aggregation reproduces the
    sequence-level GSPO gradient exactly; token-mean weights sequences by length.
    Every token of a sequence holds the bit-identical value s_i, so clipping
    (and the clip metrics) is decided once per sequence. The paper's bounds are tiny
    (low 3e-4, high 4e-4); the 0.2 defaults only keep the signature uniform,
    so pass GSPO's own bounds explicitly.
    clip_ratio_c is accepted for a uniform signature and ignored (GSPO has no
    dual clip). ratio_* metrics report s_i per valid token; the detached
    sequence log-ratio is clamped to [-20, 20] (verl clamps log s_it at 10,
    from above only). Shapes: see module docstring.
    """
    logp, old, adv_NT, valid, w, zero = _prepare(
        logp_NT, old_logp_NT, adv, mask_NT, weight_NT, clip_ratio_low, clip_ratio_high, "gspo"
    )
    lo, hi = _bounds(clip_ratio_low, clip_ratio_high)
    d_NT = logp - old
    len_N = valid.sum(dim=1).clamp(min=1).to(logp.dtype)
    seq_d_N = (d_NT.sum(dim=1) / len_N).detach().clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    # s_i is computed once per row and multiplied by exp(logp - sg[logp]), which
    # is exactly 1 in value (x - x = 0, exp(0) = 1), so every token of row i holds
    # the bit-identical s_i: one clip decision per sequence. The unbracketed
    # exp(seq_d + logp - sg[logp]) rounds seq_d + logp first (float32 ulp at
    # |logp| ~ 30 is 2e-6, GSPO's bounds are ~3e-4), so tokens of one sequence
    # could land on different sides of a bound.
    s_N = torch.exp(seq_d_N)
    s_NT = s_N[:, None] * torch.exp(logp - logp.detach())
    high_NT = (adv_NT > 0) & (s_NT > hi) if hi is not None else torch.zeros_like(valid)
    low_NT = (adv_NT < 0) & (s_NT < lo) if lo is not None else torch.zeros_like(valid)
    # Branch on the flags rather than max(-A s, -A clip(s)): the two products can
    # round to the same value when s is within an ulp of a bound, and max() then
    # gives half a gradient to a sequence the metrics count as clipped.
    pg_NT = torch.where(high_NT | low_NT, -adv_NT * _clip(s_NT, lo, hi), -adv_NT * s_NT)
    metrics = _metrics(s_NT, d_NT.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), valid, low_NT, high_NT)
    return _finish(pg_NT, valid, w, zero), metrics


def cispo_loss(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv: Tensor,
    mask_NT: Tensor,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = 0.2,
    clip_ratio_c: float | None = None,
    weight_NT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO per-token loss (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, Sec. 3.1).

        rho_t = exp(logp_t - old_t)
        w_t   = sg[clip(rho_t, 1 - low, 1 + high)]
        l_t   = -w_t * A_t * logp_t
    Unlike PPO, no token's gradient is dropped: the importance weight is clipped
    and detached, and the gradient -w_t A_t grad logp_t flows on every valid
    token. The loss VALUE is not a surrogate of the return (it contains logp);
    only its gradient is meaningful.
    Bounds: MiniMax clips only from above in practice, so this function's
    default is clip_ratio_low=None (no lower bound); any clip_ratio_low >= 1
    has the same effect. Pass a number to enable the lower bound. verl's CISPO
    differs: its lower bound is on by default (1 - clip_ratio_low, with
    clip_ratio_low = 0.2 in verl's actor config).
    Active bounds (for the clip_frac metrics) ignore the sign of A: upper when
    rho > 1 + high, lower when rho < 1 - low. clip_ratio_c is accepted and
    ignored. Shapes: see module docstring.
    """
    logp, old, adv_NT, valid, w, zero = _prepare(
        logp_NT, old_logp_NT, adv, mask_NT, weight_NT, clip_ratio_low, clip_ratio_high, "cispo"
    )
    lo, hi = _bounds(clip_ratio_low, clip_ratio_high)
    d_NT = (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio_NT = torch.exp(d_NT)
    is_weight_NT = _clip(ratio_NT, lo, hi).detach()
    pg_NT = -is_weight_NT * adv_NT * logp
    high_NT = ratio_NT > hi if hi is not None else torch.zeros_like(valid)
    low_NT = ratio_NT < lo if lo is not None else torch.zeros_like(valid)
    metrics = _metrics(ratio_NT, d_NT, valid, low_NT, high_NT)
    return _finish(pg_NT, valid, w, zero), metrics


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def compute_policy_loss(
    name: str, logp_NT: Tensor, old_logp_NT: Tensor, adv: Tensor, mask_NT: Tensor, **kwargs
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dispatch to POLICY_LOSSES[name]; keyword arguments go to the loss unchanged."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name](logp_NT, old_logp_NT, adv, mask_NT, **kwargs)
