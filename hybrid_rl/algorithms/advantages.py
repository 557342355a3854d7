"""Outcome-reward advantage estimators for group-sampled RL (GRPO family, REINFORCE++).

Shape legend:
    N  number of sequences in the batch (B prompts x G samples each)
    B  number of prompts (groups); groups may have unequal sizes
    T  response tokens (padded; mask_NT says which are valid)
    _N a tensor with one entry per sequence, _NT one entry per response token

Two kinds of estimator:
    sequence-level  grpo, drgrpo, rloo:
        fn(rewards_N, group_ids_N, eps=1e-6) -> adv_N
        one scalar per sequence, from statistics of its group.
    token-level     reinforce_pp, reinforce_pp_baseline (TOKEN_LEVEL_ESTIMATORS):
        -> adv_NT, one value per response token, whitened over every valid
        token of the global batch (see reinforce_pp_advantages).
compute_advantages is the one entry point for the trainer: it always returns
(N, T), broadcasting sequence-level advantages over the valid tokens.

group_ids_N holds arbitrary integer ids (not necessarily contiguous or sorted)
saying which prompt each sequence was sampled from; a group is always whole on
one rank, so group statistics are local.

Statistics are computed in float64 and cast back, because GRPO divides by a
small std and float32 round-off in the group mean would otherwise leak into
groups whose rewards are all equal. Groups whose rewards are exactly equal get
an advantage of exactly 0 for every estimator that subtracts a group baseline,
and a batch whose whitened values are all equal gets exactly 0.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "TOKEN_LEVEL_ESTIMATORS",
    "compute_advantages",
    "grpo_advantages",
    "drgrpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
]


def _check_scores(rewards_N: Tensor, eps: float, what: str) -> None:
    if not isinstance(rewards_N, Tensor) or rewards_N.dim() != 1:
        raise ValueError(
            f"{what} must be a 1-D tensor of shape (N,), got "
            f"{getattr(rewards_N, 'shape', type(rewards_N))}; flatten (B, G) rewards with .reshape(-1)"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards_N.numel() and not bool(torch.isfinite(rewards_N.double()).all()):
        raise ValueError(f"{what} contains NaN or inf; fix the reward function before computing advantages")


def _check_inputs(rewards_N: Tensor, group_ids_N: Tensor, eps: float, what: str = "rewards_N") -> None:
    _check_scores(rewards_N, eps, what)
    if not isinstance(group_ids_N, Tensor) or group_ids_N.shape != rewards_N.shape:
        raise ValueError(
            f"group_ids_N must be a tensor with the same shape as {what} {tuple(rewards_N.shape)}, "
            f"got {getattr(group_ids_N, 'shape', type(group_ids_N))}"
        )
    if group_ids_N.dtype.is_floating_point or group_ids_N.dtype.is_complex or group_ids_N.dtype == torch.bool:
        raise ValueError(f"group_ids_N must hold integer ids (e.g. torch.long), got dtype {group_ids_N.dtype}")


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


# ---------------------------------------------------------------- token level: REINFORCE++

ReduceSum = Callable[[Tensor], Tensor]
_EPS64 = torch.finfo(torch.float64).eps
_N_STATS = 5


def _check_mask(mask_NT: Tensor, n: int) -> None:
    if not isinstance(mask_NT, Tensor) or mask_NT.dim() != 2 or mask_NT.shape[0] != n:
        raise ValueError(
            f"mask_NT must be the 2-D (N, T) response mask with N = {n} rows (one per score), got "
            f"{getattr(mask_NT, 'shape', type(mask_NT))}; pass the response-token mask, not the "
            "prompt + response attention mask"
        )


def _reward_NT(scores_N: Tensor, valid_NT: Tensor, kl_NT: Tensor | None, kl_coef: float) -> Tensor:
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


def _discounted_returns(r_NT: Tensor, valid_NT: Tensor, gamma: float) -> Tensor:
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


def _local_moments(x_NT: Tensor, valid_NT: Tensor) -> Tensor:
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


def _whiten_valid(x_NT: Tensor, valid_NT: Tensor, eps: float, reduce_sum: ReduceSum | None,
                  stats_NT: Tensor | None = None) -> Tensor:
    """(x - mean) / (std + eps) over the valid tokens of every rank; 0 at masked positions.
    stats_NT: the tokens mean and std are taken over (default: valid_NT), e.g. only those the loss trains.

    One reduce_sum call on the 5 statistics of _local_moments. The variance is
    within-rank squared deviations plus the between-rank part
    sum_r n_r m_r^2 - n mean^2. The latter is a difference of two nearly equal
    sums, so values within its rounding bound ((4 R + 8) eps64 sum_r n_r m_r^2
    for R ranks) are treated as 0: then one rank's result does not depend on
    round-off, and a batch whose values are all equal (on one rank or many)
    gets a variance of exactly 0 and an advantage of exactly 0.
    std is unbiased (divides by n - 1), as verl's masked_whiten; n < 2 gives 0.
    """
    stats = _local_moments(x_NT, valid_NT if stats_NT is None else stats_NT)
    if reduce_sum is not None:
        # Every rank must reach this call, also with an empty local batch.
        stats = reduce_sum(stats)
        if not isinstance(stats, Tensor) or stats.shape != (_N_STATS,):
            raise ValueError(
                f"reduce_sum must return the summed float64 ({_N_STATS},) tensor it was given, got "
                f"{getattr(stats, 'shape', type(stats))}; pass e.g. hybrid_rl.distributed.all_reduce_sum"
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


def _check_kl(kl_NT: Tensor | None, kl_coef: float, mask_NT: Tensor) -> None:
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


def reinforce_pp_advantages(
    scores_N: Tensor,
    mask_NT: Tensor,
    *,
    gamma: float = 1.0,
    kl_NT: Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-6,
    reduce_sum: ReduceSum | None = None,
    stats_mask_NT: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ token-level advantage (Hu et al. 2025, arXiv:2501.03262, Eqs. for A_t and its normalisation).

    Token rewards on the valid tokens of row i (mask_NT != 0):
        r_it = -kl_coef * kl_it  (only if kl_NT is given)  +  scores_N[i] on the last valid token
    Returns, discounted over valid tokens only (padding in between is skipped):
        G_it = sum_{s >= t valid} gamma^(number of valid tokens in [t, s)) r_is
    With gamma = 1 this is the paper's A_t = r(x, y) - beta * sum_{s >= t} KL(s)
    (the "KL-to-go"). Then whitening over every valid token of the GLOBAL batch,
    so a long response weighs more than a short one:
        A_it = (G_it - mean(G)) / (std(G) + eps)
    std is the unbiased (n - 1) token std, as verl's masked_whiten; verl divides
    by sqrt(var + 1e-8) instead of (std + eps). When every valid return is equal
    (or there are fewer than 2 valid tokens) the result is exactly 0.

    Args:
        scores_N: (N,) outcome score per sequence (int or float).
        mask_NT: (N, T) response mask (bool or 0/1); rows may be empty.
        gamma: discount in [0, 1].
        kl_NT: optional (N, T) per-token KL estimate of the policy vs the
            reference (e.g. kl_estimate(..., "k1")); treated as a constant.
        kl_coef: KL coefficient >= 0; nonzero only together with kl_NT.
        eps: added to the std.
        reduce_sum: for data-parallel training, a callable that all-reduce-sums
            a float64 tensor in place and returns it (e.g.
            hybrid_rl.distributed.all_reduce_sum). It is called exactly once,
            on every rank, so the mean and std are over all ranks' tokens.
            None: this batch is the whole batch.
        stats_mask_NT: the tokens the mean and std are taken over (default:
            mask_NT). The trainer passes its loss mask: tokens the overlong
            filter or rollout correction leave out of the loss do not move the
            baseline of those it trains (verl whitens after its rejection mask).
    Returns:
        adv_NT: (N, T) on mask_NT's device, scores' float dtype (float32 for
        int scores), 0 at masked positions.
    """
    _check_scores(scores_N, eps, "scores_N")
    _check_mask(mask_NT, scores_N.shape[0])
    _check_kl(kl_NT, kl_coef, mask_NT)
    stats_NT = _stats_mask(stats_mask_NT, mask_NT)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    valid_NT = mask_NT != 0
    r_NT = _reward_NT(scores_N.to(mask_NT.device), valid_NT, None if kl_NT is None else kl_NT.to(mask_NT.device),
                      kl_coef)
    g_NT = _discounted_returns(r_NT, valid_NT, gamma)
    return _whiten_valid(g_NT, valid_NT, eps, reduce_sum, stats_NT).to(_out_dtype(scores_N))


def _stats_mask(stats_mask_NT: Tensor | None, mask_NT: Tensor) -> Tensor | None:
    """The whitening tokens as a bool mask within mask_NT, or None (= mask_NT)."""
    if stats_mask_NT is None:
        return None
    if not isinstance(stats_mask_NT, Tensor) or stats_mask_NT.shape != mask_NT.shape:
        raise ValueError(f"stats_mask_NT must have the (N, T) shape of mask_NT {tuple(mask_NT.shape)}, got "
                         f"{getattr(stats_mask_NT, 'shape', type(stats_mask_NT))}")
    return (stats_mask_NT.to(mask_NT.device) != 0) & (mask_NT != 0)


def reinforce_pp_baseline_advantages(
    scores_N: Tensor,
    group_ids_N: Tensor,
    mask_NT: Tensor,
    *,
    eps: float = 1e-6,
    reduce_sum: ReduceSum | None = None,
    stats_mask_NT: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ with baseline (Hu et al. 2025, arXiv:2501.03262, "REINFORCE++ w/ baseline").

        c_i   = r_i - mean_g(r)                 group baseline (0 for a group whose
                                                 scores are all equal, e.g. of size 1)
        A_it  = (c_i - mean(c)) / (std(c) + eps) on every valid token of row i
    mean and std are over every valid token of the global batch (each sequence
    counts once per token, so it is length-weighted and mean(c) is not 0 in
    general); unbiased std, as verl's masked_whiten. The group mean is local:
    a group is always whole on one rank. verl keeps the raw score of a group of
    size 1 (baseline 0); here it gets c = 0 like every equal-score group.

    Args:
        scores_N: (N,) outcome score per sequence.
        group_ids_N: (N,) integer prompt id of each sequence.
        mask_NT: (N, T) response mask.
        eps, reduce_sum, stats_mask_NT: as reinforce_pp_advantages.
    Returns:
        adv_NT: (N, T), as reinforce_pp_advantages.
    """
    _check_inputs(scores_N, group_ids_N, eps, "scores_N")
    _check_mask(mask_NT, scores_N.shape[0])
    stats_NT = _stats_mask(stats_mask_NT, mask_NT)
    device = mask_NT.device
    c_N = _GroupStats(scores_N.to(device), group_ids_N.to(device)).centred_N
    valid_NT = mask_NT != 0
    c_NT = c_N[:, None].expand(valid_NT.shape)
    return _whiten_valid(c_NT, valid_NT, eps, reduce_sum, stats_NT).to(_out_dtype(scores_N))


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}
# Estimators whose result is per token (the others give one value per sequence).
TOKEN_LEVEL_ESTIMATORS = frozenset({"reinforce_pp", "reinforce_pp_baseline"})


def compute_advantages(
    name: str,
    scores_N: Tensor,
    group_ids_N: Tensor,
    mask_NT: Tensor,
    *,
    eps: float = 1e-6,
    gamma: float = 1.0,
    kl_NT: Tensor | None = None,
    kl_coef: float = 0.0,
    reduce_sum: ReduceSum | None = None,
    stats_mask_NT: Tensor | None = None,
) -> Tensor:
    """Advantages of any estimator in ADVANTAGE_ESTIMATORS as a (N, T) tensor.

    Sequence-level estimators (grpo, drgrpo, rloo) compute adv_N from the group
    statistics and put it on every valid token of its row. Token-level ones
    (TOKEN_LEVEL_ESTIMATORS) are computed per token, see their functions.
    gamma, kl_NT and kl_coef are only for reinforce_pp; passing them to another
    estimator raises rather than being ignored. reduce_sum is only used by the
    token-level estimators (the others need no statistics beyond one group,
    which is whole on one rank), and must then be passed on every rank; so is
    stats_mask_NT, the tokens their whitening statistics are taken over.

    Args:
        name: a key of ADVANTAGE_ESTIMATORS.
        scores_N: (N,) outcome score per sequence.
        group_ids_N: (N,) integer prompt id of each sequence.
        mask_NT: (N, T) response mask (bool or 0/1).
    Returns:
        adv_NT: (N, T) float tensor on mask_NT's device (scores' float dtype,
        float32 for int scores), 0 at masked positions.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}")
    _check_inputs(scores_N, group_ids_N, eps, "scores_N")
    _check_mask(mask_NT, scores_N.shape[0])
    if name == "reinforce_pp":
        return reinforce_pp_advantages(
            scores_N, mask_NT, gamma=gamma, kl_NT=kl_NT, kl_coef=kl_coef, eps=eps, reduce_sum=reduce_sum,
            stats_mask_NT=stats_mask_NT,
        )
    if kl_NT is not None or kl_coef != 0.0:
        raise ValueError(
            f"advantage estimator {name!r} does not take kl_NT / kl_coef (a per-token KL reward is only "
            "defined for 'reinforce_pp'); use a KL loss, or put the KL in the scores with kl_penalty_rewards"
        )
    if gamma != 1.0:
        raise ValueError(f"advantage estimator {name!r} has no discount; gamma={gamma} applies only to 'reinforce_pp'")
    if name == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(scores_N, group_ids_N, mask_NT, eps=eps, reduce_sum=reduce_sum,
                                                stats_mask_NT=stats_mask_NT)
    device = mask_NT.device
    adv_N = ADVANTAGE_ESTIMATORS[name](scores_N.to(device), group_ids_N.to(device), eps=eps)
    return torch.where(mask_NT != 0, adv_N[:, None], torch.zeros((), dtype=adv_N.dtype, device=device))
