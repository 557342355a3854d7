"""PPO with a critic: token rewards, GAE advantages and returns, the clipped value loss, explained variance.

Shape legend:
    N   sequences (B prompts x G samples), T response tokens (padded)
    _NT one entry per response token, _N one per sequence

Masking: mask_NT is 1 on the tokens the policy generated and 0 elsewhere, i.e. on the
right padding and, in a multi-turn episode, on the observation tokens between two turns
(DESIGN.md, "Episodes"). A masked token is not a step of the decision process: it
neither bootstraps nor accumulates. The value and TD-error chain jumps over it from a
generated token to the next generated one, with one factor of gamma (lam) per jump, as
verl's compute_gae_advantage_return (verl/trainer/ppo/core_algos.py) does: GAE
(Schulman et al. 2016, arXiv:1506.02438) run on the subsequence of generated tokens.

Alignment: values_NT[i, t] is V of the state before response token t (the critic's
output at position P-1+t, models/value.py response_values), the same (N, T) layout
as the log-probs, so delta_t = r_t + gamma V_next(t) - V_t uses V_next(t), the value
before the next generated token, and 0 after the last one (the episode ends there).

Every function here is pure: tensors in, tensors out, nothing differentiated except
vpreds_NT in value_loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hybrid_rl.algorithms.aggregation import aggregate_loss, normalizer_count
from hybrid_rl.algorithms.returns import check_token_kl, discounted_returns, token_rewards
from hybrid_rl.algorithms.whitening import ReduceSum, local_moments, stats_mask, whiten_valid

__all__ = ["outcome_token_rewards", "gae_advantages_returns", "value_loss", "explained_variance"]


def _check_NT(what: str, x: Tensor, shape: tuple[int, ...] | None, *, floating: bool = True) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"{what} must be a 2-D (N, T) tensor, got {getattr(x, 'shape', type(x))}")
    if shape is not None and tuple(x.shape) != shape:
        raise ValueError(
            f"{what} must have the (N, T) shape {shape} of the other inputs, got {tuple(x.shape)}; every input is "
            "laid out over the same response tokens (response_logprobs / response_values)"
        )
    if floating and not x.dtype.is_floating_point:
        raise ValueError(f"{what} must be a float tensor, got dtype {x.dtype}")


def _check_finite_valid(what: str, x_NT: Tensor, valid_NT: Tensor) -> None:
    zero = torch.zeros((), dtype=x_NT.dtype, device=x_NT.device)
    if not bool(torch.isfinite(torch.where(valid_NT, x_NT.detach(), zero)).all()):
        raise ValueError(f"{what} has NaN or inf on tokens of the mask; check the model that produced it")


def _out_dtype(*xs: Tensor) -> torch.dtype:
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype if dtype.is_floating_point else torch.float32


def outcome_token_rewards(
    scores_N: Tensor, mask_NT: Tensor, *, kl_NT: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Token-level rewards of an outcome-scored batch, the r_NT of gae_advantages_returns.

        r_it = scores_N[i] on the last token of row i with mask 1  (0 for an empty row)
               - kl_coef * kl_it on every token with mask 1        (only when kl_NT is given)
    and 0 on every token with mask 0, so a multi-turn episode's score sits on the last
    token of its last generated turn. This is the InstructGPT-style reward-side KL per
    token (KL in the reward, kl_placement="reward"); kl_penalty_rewards is the same penalty
    folded into one score per sequence for estimators without token rewards.

    Args:
        scores_N: (N,) outcome score per sequence (int or float).
        mask_NT: (N, T) response mask (bool or 0/1).
        kl_NT: optional (N, T) per-token KL estimate of the policy vs the reference
            (kl_estimate); treated as a constant.
        kl_coef: KL coefficient >= 0, nonzero only together with kl_NT.
    Returns:
        rewards_NT: (N, T), the scores' float dtype (float32 for int scores), 0 where mask_NT is 0.
    """
    if not isinstance(scores_N, Tensor) or scores_N.dim() != 1:
        raise ValueError(f"scores_N must be a 1-D (N,) tensor, got {getattr(scores_N, 'shape', type(scores_N))}")
    _check_NT("mask_NT", mask_NT, None, floating=False)
    if mask_NT.shape[0] != scores_N.shape[0]:
        raise ValueError(f"mask_NT has {mask_NT.shape[0]} rows for {scores_N.shape[0]} scores; pass one row per score")
    if scores_N.numel() and not bool(torch.isfinite(scores_N.double()).all()):
        raise ValueError("scores_N contains NaN or inf; fix the reward function before computing rewards")
    check_token_kl(kl_NT, kl_coef, mask_NT)
    valid_NT = mask_NT != 0
    kl = None if kl_NT is None else kl_NT.to(mask_NT.device)
    r_NT = token_rewards(scores_N.to(mask_NT.device), valid_NT, kl, kl_coef)
    return r_NT.to(_out_dtype(scores_N))


def _next_valid_values(values_NT: Tensor, valid_NT: Tensor) -> Tensor:
    """V at the first token s > t with mask 1, for every t; 0 where no such token follows (the episode ended)."""
    N, T = values_NT.shape
    idx_T = torch.arange(T, device=values_NT.device)
    # T stands for "none": it indexes the appended 0 column below.
    pos_NT = torch.where(valid_NT, idx_T, T)
    first_at_or_after_NT = pos_NT.flip(1).cummin(dim=1).values.flip(1)
    next_NT = F.pad(first_at_or_after_NT[:, 1:], (0, 1), value=T)
    padded_NT1 = torch.cat([values_NT, torch.zeros((N, 1), dtype=values_NT.dtype, device=values_NT.device)], dim=1)
    return padded_NT1.gather(1, next_NT)


def gae_advantages_returns(
    token_level_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
    *,
    eps: float = 1e-6,
    reduce_sum: ReduceSum | None = None,
    stats_mask_NT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GAE advantages and value targets (Schulman et al. 2016, arXiv:1506.02438, Eqs. 11-16).

    Over the tokens with mask 1 of each row, s(t) being the next such token after t:
        delta_t = r_t + gamma * V_{s(t)} - V_t            (V_{s(t)} = 0 after the last one)
        A_t     = delta_t + gamma * lam * A_{s(t)}        (= sum_l (gamma lam)^l delta_{t+l} on that subsequence)
        R_t     = A_t + V_t                               (returns: the critic's regression target)
    Tokens with mask 0 are skipped (module docstring): their values are never read,
    and a reward on them is refused rather than dropped. With whiten=True the
    advantages are whitened over every token with mask 1 of the global batch,
    (A - mean) / (std + eps) with the unbiased std (whitening.whiten_valid), as verl
    whitens GAE by default (it divides by sqrt(var + 1e-8) instead); the returns are
    never whitened. lam = 1 gives the Monte Carlo return R_t = sum of discounted future
    rewards whatever V is; lam = 0 the one-step TD target R_t = r_t + gamma V_{s(t)}.

    Args:
        token_level_rewards: (N, T) float reward per token (outcome_token_rewards), 0 where mask is 0.
        values: (N, T) float V of the state before each response token (response_values, old critic).
        mask: (N, T) response mask (bool or 0/1): 1 on generated tokens.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].
        whiten: whiten the advantages (verl's default for GAE).
        eps: added to the std when whitening.
        reduce_sum: for data-parallel training, a callable that all-reduce-sums a float64
            tensor and returns it (hybrid_rl.runtime.distributed.all_reduce_sum), called once on
            every rank when whiten=True; None: this batch is the whole batch.
        stats_mask_NT: the tokens the whitening mean and std are taken over (default: mask),
            e.g. the loss mask after filtering, as reinforce_pp_advantages.
    Returns:
        (advantages_NT, returns_NT): (N, T) each, detached, in the promoted float dtype of
        rewards and values, 0 where mask is 0.
    """
    _check_NT("values", values, None)
    shape = tuple(values.shape)
    _check_NT("token_level_rewards", token_level_rewards, shape)
    _check_NT("mask", mask, shape, floating=False)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:  # NaN fails this too
            raise ValueError(f"{name} must be in [0, 1], got {x} (config key 'algorithm.{name}')")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    device = values.device
    valid_NT = mask.to(device) != 0
    r = token_level_rewards.detach().to(device=device, dtype=torch.float64)
    v = values.detach().to(torch.float64)
    if bool((torch.where(valid_NT, torch.zeros_like(r), r) != 0).any()):
        raise ValueError(
            "token_level_rewards is nonzero on tokens with mask 0 (padding or observation tokens), where GAE would "
            "drop it; put the outcome on the last generated token (outcome_token_rewards)"
        )
    _check_finite_valid("token_level_rewards", r, valid_NT)
    _check_finite_valid("values", v, valid_NT)
    stats_NT = stats_mask(stats_mask_NT, valid_NT)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    v = torch.where(valid_NT, v, zero)
    delta_NT = torch.where(valid_NT, r + gamma * _next_valid_values(v, valid_NT) - v, zero)
    # The scan skips masked tokens: they neither add nor discount.
    adv_NT = discounted_returns(delta_NT, valid_NT, gamma * lam)
    ret_NT = torch.where(valid_NT, adv_NT + v, zero)
    if whiten:
        adv_NT = whiten_valid(adv_NT, valid_NT, eps, reduce_sum, stats_NT)
    out = _out_dtype(token_level_rewards, values)
    return adv_NT.to(out), ret_NT.to(out)


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    old_values: Tensor,
    mask: Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str,
    *,
    global_normalizer: float | Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss and its clip fraction (verl's compute_value_loss semantics).

        v_clip_t = old_t + clamp(v_t - old_t, -c, c)
        l_t      = max((v_t - R_t)^2, (v_clip_t - R_t)^2)
        loss     = 0.5 * aggregate_loss(l_NT, mask, loss_agg_mode, D)
        clipfrac = fraction of tokens with mask 1 where (v_clip - R)^2 > (v - R)^2 (the clipped error wins)
    The clip keeps the new value within c of the value the batch was scored with
    (old_values), as the policy's ratio clip does; cliprange_value=None disables it
    (l = (v - R)^2, clipfrac 0). Gradients flow only through vpreds; returns and
    old_values are constants, and masked positions (which may hold NaN) are zeroed before
    any arithmetic.

    Args:
        vpreds: (N, T) values of the critic being trained (response_values with grad).
        returns: (N, T) value targets (gae_advantages_returns).
        old_values: (N, T) values the batch was scored with (response_values at SCORE).
        mask: (N, T) response mask (bool or 0/1), normally the actor's loss mask.
        cliprange_value: c > 0, or None for no clipping (verl: critic.cliprange_value, 0.5).
        loss_agg_mode: one of aggregation.LOSS_AGG_MODES.
        global_normalizer: D, the mini-batch's summed normalizer_count over micro-batches and
            ranks (aggregation.py); None: this call's own count, i.e. this batch is the whole
            mini-batch on one rank.
        norm_length: the constant length of "seq-mean-token-sum-norm".
    Returns:
        (loss, clipfrac): 0-d tensors; loss in the work dtype (float32, float64 for float64
        vpreds) with the graph of vpreds, clipfrac float32 and detached (0 with no valid token).
    """
    _check_NT("vpreds", vpreds, None)
    shape = tuple(vpreds.shape)
    _check_NT("returns", returns, shape)
    _check_NT("old_values", old_values, shape)
    _check_NT("mask", mask, shape, floating=False)
    if cliprange_value is not None and not cliprange_value > 0:
        raise ValueError(
            f"cliprange_value must be > 0 or None (no clipping), got {cliprange_value} "
            "(config key 'critic.cliprange_value')"
        )
    dtype = torch.float64 if vpreds.dtype == torch.float64 else torch.float32
    valid_NT = mask.to(vpreds.device) != 0
    zero = torch.zeros((), dtype=dtype, device=vpreds.device)
    v = torch.where(valid_NT, vpreds.to(dtype), zero)
    ret = torch.where(valid_NT, returns.detach().to(device=vpreds.device, dtype=dtype), zero)
    old = torch.where(valid_NT, old_values.detach().to(device=vpreds.device, dtype=dtype), zero)
    unclipped_NT = (v - ret).square()
    if cliprange_value is None:
        loss_NT = unclipped_NT
        clipped_wins_NT = torch.zeros_like(valid_NT)
    else:
        v_clip = old + (v - old).clamp(-cliprange_value, cliprange_value)
        clipped_NT = (v_clip - ret).square()
        loss_NT = torch.maximum(unclipped_NT, clipped_NT)
        clipped_wins_NT = clipped_NT.detach() > unclipped_NT.detach()
    if global_normalizer is None:
        global_normalizer = normalizer_count(valid_NT, loss_agg_mode)
    loss = 0.5 * aggregate_loss(loss_NT, valid_NT, loss_agg_mode, global_normalizer, norm_length)
    n = valid_NT.sum().clamp(min=1)
    clipfrac = ((clipped_wins_NT & valid_NT).sum() / n).float()
    return loss, clipfrac


def _variance(stats: Tensor) -> Tensor:
    """Unbiased variance from whitening.local_moments' (summed) statistics; 0 for fewer than 2 values."""
    n, total, m2_within, sq_means, _ = stats.unbind()
    mean = total / n.clamp(min=1.0)
    m2 = (m2_within + (sq_means - total * mean)).clamp(min=0.0)
    return torch.where(n > 1, m2 / (n - 1.0).clamp(min=1.0), torch.zeros_like(m2))


def explained_variance(
    values: Tensor, returns: Tensor, mask: Tensor, *, eps: float = 1e-5, reduce_sum: ReduceSum | None = None
) -> Tensor:
    """How much of the returns' variance the values explain: 1 - Var(R - V) / (Var(R) + eps).

    Over the tokens with mask 1 (of every rank when reduce_sum is given, called once on
    every rank), unbiased variances, as verl's critic/vf_explained_var metric. 1 is a
    perfect critic, 0 one no better than a constant, negative one worse than a constant;
    0 with fewer than 2 valid tokens.

    Args:
        values: (N, T) critic values (old_values or vpreds).
        returns: (N, T) value targets.
        mask: (N, T) response mask (bool or 0/1).
        eps: added to Var(R) (verl: 1e-5).
        reduce_sum: as gae_advantages_returns.
    Returns:
        a 0-d float32 tensor, detached.
    """
    _check_NT("values", values, None)
    _check_NT("returns", returns, tuple(values.shape))
    _check_NT("mask", mask, tuple(values.shape), floating=False)
    valid_NT = mask.to(values.device) != 0
    v = values.detach().to(torch.float64)
    ret = returns.detach().to(device=values.device, dtype=torch.float64)
    stats = torch.cat([local_moments(ret - v, valid_NT), local_moments(ret, valid_NT)])
    if reduce_sum is not None:
        stats = reduce_sum(stats)
    n = stats[0]
    ev = 1.0 - _variance(stats[:5]) / (_variance(stats[5:]) + eps)
    return torch.where(n > 1, ev, torch.zeros_like(ev)).float()
