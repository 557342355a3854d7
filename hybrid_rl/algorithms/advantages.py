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
        token of the global batch (whitening.py; returns.py for REINFORCE++'s
        token returns).
ADVANTAGE_ESTIMATORS is the table: each entry (Estimator) has one signature,
fn(AdvantageInputs) -> adv_NT, and flags saying what it takes (a per-token KL,
a discount) and needs (a group baseline). compute_advantages is the one entry
point for the trainer: it checks the inputs, refuses settings the entry's flags
do not take, and calls the entry; it always returns (N, T).

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

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from hybrid_rl.algorithms.gae import gae_advantages_returns, outcome_token_rewards
from hybrid_rl.algorithms.returns import check_token_kl, discounted_returns, token_rewards
from hybrid_rl.algorithms.whitening import ReduceSum, stats_mask, whiten_valid

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "TOKEN_LEVEL_ESTIMATORS",
    "AdvantageInputs",
    "Estimator",
    "estimator",
    "takes_token_kl",
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


def _check_mask(mask_NT: Tensor, n: int) -> None:
    if not isinstance(mask_NT, Tensor) or mask_NT.dim() != 2 or mask_NT.shape[0] != n:
        raise ValueError(
            f"mask_NT must be the 2-D (N, T) response mask with N = {n} rows (one per score), got "
            f"{getattr(mask_NT, 'shape', type(mask_NT))}; pass the response-token mask, not the "
            "prompt + response attention mask"
        )


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
            hybrid_rl.runtime.distributed.all_reduce_sum). It is called exactly once,
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
    check_token_kl(kl_NT, kl_coef, mask_NT)
    stats_NT = stats_mask(stats_mask_NT, mask_NT)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    valid_NT = mask_NT != 0
    r_NT = token_rewards(
        scores_N.to(mask_NT.device), valid_NT, None if kl_NT is None else kl_NT.to(mask_NT.device), kl_coef
    )
    g_NT = discounted_returns(r_NT, valid_NT, gamma)
    return whiten_valid(g_NT, valid_NT, eps, reduce_sum, stats_NT).to(_out_dtype(scores_N))


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
    stats_NT = stats_mask(stats_mask_NT, mask_NT)
    device = mask_NT.device
    c_N = _GroupStats(scores_N.to(device), group_ids_N.to(device)).centred_N
    valid_NT = mask_NT != 0
    c_NT = c_N[:, None].expand(valid_NT.shape)
    return whiten_valid(c_NT, valid_NT, eps, reduce_sum, stats_NT).to(_out_dtype(scores_N))


# ---------------------------------------------------------------- the table: one signature for every estimator


@dataclass(frozen=True)
class AdvantageInputs:
    """What every estimator in ADVANTAGE_ESTIMATORS receives: the batch and all settings.

    scores_N (N,), group_ids_N (N,) and mask_NT (N, T) as compute_advantages;
    an estimator reads the fields it uses. compute_advantages checks them first
    and refuses kl_NT / kl_coef / gamma for an estimator whose flags say it does
    not take them, so none is silently ignored.
    """

    scores_N: Tensor
    group_ids_N: Tensor
    mask_NT: Tensor
    eps: float = 1e-6
    gamma: float = 1.0
    kl_NT: Tensor | None = None
    kl_coef: float = 0.0
    reduce_sum: ReduceSum | None = None
    stats_mask_NT: Tensor | None = None
    values_NT: Tensor | None = None  # the critic's values (estimators with `critic`)
    lam: float = 1.0  # GAE's lambda (estimators with `critic`)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: fn(AdvantageInputs) -> adv_NT (N, T), and what it takes.

    token_kl: takes the per-token KL (kl_NT, kl_coef) as a reward in its token returns;
        for the others a reward-side KL is folded into the scores (kl_penalty_rewards).
    discounted: takes gamma, a discount over its token returns.
    token_level: one value per token, whitened over the valid tokens of every rank
        (reduce_sum and stats_mask_NT apply); else one value per sequence, broadcast.
    group_baseline: its baseline comes from the prompt's group (needs >= 2 samples per prompt).
    critic: its baseline is a learned value per token (values_NT, lam): PPO with a critic.
    """

    fn: Callable[[AdvantageInputs], Tensor]
    token_kl: bool = False
    discounted: bool = False
    token_level: bool = False
    group_baseline: bool = True
    critic: bool = False


def _per_sequence(seq_fn: Callable[..., Tensor]) -> Callable[[AdvantageInputs], Tensor]:
    """A sequence-level estimator (rewards_N, group_ids_N, eps) -> adv_N, put on every valid token of its row."""

    def fn(x: AdvantageInputs) -> Tensor:
        device = x.mask_NT.device
        adv_N = seq_fn(x.scores_N.to(device), x.group_ids_N.to(device), eps=x.eps)
        return torch.where(x.mask_NT != 0, adv_N[:, None], torch.zeros((), dtype=adv_N.dtype, device=device))

    return fn


def _reinforce_pp(x: AdvantageInputs) -> Tensor:
    return reinforce_pp_advantages(
        x.scores_N,
        x.mask_NT,
        gamma=x.gamma,
        kl_NT=x.kl_NT,
        kl_coef=x.kl_coef,
        eps=x.eps,
        reduce_sum=x.reduce_sum,
        stats_mask_NT=x.stats_mask_NT,
    )


def _reinforce_pp_baseline(x: AdvantageInputs) -> Tensor:
    return reinforce_pp_baseline_advantages(
        x.scores_N, x.group_ids_N, x.mask_NT, eps=x.eps, reduce_sum=x.reduce_sum, stats_mask_NT=x.stats_mask_NT
    )


def _gae(x: AdvantageInputs) -> Tensor:
    rewards_NT = outcome_token_rewards(x.scores_N, x.mask_NT, kl_NT=x.kl_NT, kl_coef=x.kl_coef)
    adv_NT, _ = gae_advantages_returns(
        rewards_NT,
        x.values_NT,
        x.mask_NT,
        x.gamma,
        x.lam,
        eps=x.eps,
        reduce_sum=x.reduce_sum,
        stats_mask_NT=x.stats_mask_NT,
    )
    return adv_NT


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_per_sequence(grpo_advantages)),
    "drgrpo": Estimator(_per_sequence(drgrpo_advantages)),
    "rloo": Estimator(_per_sequence(rloo_advantages)),
    # REINFORCE++ whitens over the whole batch: no group baseline, so one sample per prompt is its usual setting.
    "reinforce_pp": Estimator(_reinforce_pp, token_kl=True, discounted=True, token_level=True, group_baseline=False),
    "reinforce_pp_baseline": Estimator(_reinforce_pp_baseline, token_level=True),
    # PPO with a critic (issue 36): GAE over token rewards (the outcome on the last generated token, the KL per
    # token when it is in the reward) against the critic's values; one sample per prompt works.
    "gae": Estimator(_gae, token_kl=True, discounted=True, token_level=True, group_baseline=False, critic=True),
}
# Estimators whose result is per token (the others give one value per sequence).
TOKEN_LEVEL_ESTIMATORS = frozenset(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.token_level)


def estimator(name: str) -> Estimator:
    """The table entry of `name`; ValueError lists the valid names."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def takes_token_kl(name: str) -> bool:
    """Whether estimator `name` takes a reward-side KL per token (else fold it into the scores)."""
    return estimator(name).token_kl


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
    values_NT: Tensor | None = None,
    lam: float = 1.0,
) -> Tensor:
    """Advantages of any estimator in ADVANTAGE_ESTIMATORS as a (N, T) tensor.

    Sequence-level estimators (grpo, drgrpo, rloo) compute adv_N from the group
    statistics and put it on every valid token of its row. Token-level ones
    (TOKEN_LEVEL_ESTIMATORS) are computed per token, see their functions.
    gamma, kl_NT and kl_coef are only for estimators whose flags take them
    (reinforce_pp); passing them to another raises rather than being ignored.
    reduce_sum is only used by the token-level estimators (the others need no
    statistics beyond one group, which is whole on one rank), and must then be
    passed on every rank; so is stats_mask_NT, the tokens their whitening
    statistics are taken over.

    Args:
        name: a key of ADVANTAGE_ESTIMATORS.
        scores_N: (N,) outcome score per sequence.
        group_ids_N: (N,) integer prompt id of each sequence.
        mask_NT: (N, T) response mask (bool or 0/1).
    Returns:
        adv_NT: (N, T) float tensor on mask_NT's device (scores' float dtype,
        float32 for int scores), 0 at masked positions.
    """
    est = estimator(name)
    _check_inputs(scores_N, group_ids_N, eps, "scores_N")
    _check_mask(mask_NT, scores_N.shape[0])
    if not est.token_kl and (kl_NT is not None or kl_coef != 0.0):
        raise ValueError(
            f"advantage estimator {name!r} does not take kl_NT / kl_coef (a per-token KL reward is only defined "
            f"for {_names('token_kl')}); use a KL loss, or put the KL in the scores with kl_penalty_rewards"
        )
    if not est.discounted and gamma != 1.0:
        raise ValueError(
            f"advantage estimator {name!r} has no discount; gamma={gamma} applies only to {_names('discounted')}"
        )
    if est.critic != (values_NT is not None):
        raise ValueError(
            f"advantage estimator {name!r} "
            + ("needs the critic's values_NT" if est.critic else f"takes no values_NT (only {_names('critic')})")
        )
    if not est.critic and lam != 1.0:
        raise ValueError(f"advantage estimator {name!r} has no lambda; lam={lam} applies only to {_names('critic')}")
    return est.fn(
        AdvantageInputs(
            scores_N,
            group_ids_N,
            mask_NT,
            eps=eps,
            gamma=gamma,
            kl_NT=kl_NT,
            kl_coef=kl_coef,
            reduce_sum=reduce_sum,
            stats_mask_NT=stats_mask_NT,
            values_NT=values_NT,
            lam=lam,
        )
    )


def _names(flag: str) -> str:
    return ", ".join(repr(n) for n, e in ADVANTAGE_ESTIMATORS.items() if getattr(e, flag))
