"""The ADVANTAGE stage: from a scored `RolloutBatch` to the `TrainBatch` the update trains on.

    loss mask   the response tokens, less truncated completions (DAPO's overlong filter) and
                the tokens rollout correction masks (MIS); TIS gives a per-token weight instead
    KL          with the KL placed in the reward, the per-token KL to the reference: a penalty
                on the score for sequence-level estimators, per token for those that take it
                (`takes_token_kl`, REINFORCE++'s KL-to-go)
    advantages  of this rank's groups, whitening statistics over all ranks (`D.all_reduce_sum`); with a critic
                (algorithm.advantage=gae) GAE against its values, and the returns it trains on

Pure of the Trainer: a batch, its log-probs, the step's KL coefficient and the algorithm's
config in; the train batch and its metrics out. Legend: N sequences on this rank, T response tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid_rl.algorithms.advantages import compute_advantages, estimator, takes_token_kl
from hybrid_rl.algorithms.correction import rollout_correction
from hybrid_rl.algorithms.dapo import truncation_mask
from hybrid_rl.algorithms.gae import explained_variance, gae_advantages_returns, outcome_token_rewards
from hybrid_rl.algorithms.kl import kl_estimate, kl_penalty_rewards
from hybrid_rl.batch import RolloutBatch, TrainBatch
from hybrid_rl.config.schema import AlgorithmConfig
from hybrid_rl.observability.metrics import MeanAccumulator
from hybrid_rl.runtime import distributed as D


def advantage_stage(
    batch: RolloutBatch,
    old_logp_NT: Optional[torch.Tensor],
    ref_logp_NT: Optional[torch.Tensor],
    kl_coef: float,
    algo: AlgorithmConfig,
    values_NT: Optional[torch.Tensor] = None,
) -> tuple[TrainBatch, MeanAccumulator]:
    """Loss mask and correction weight, KL in the reward, advantages: the batch the update trains on, and the
    stage's metrics. old/ref_logp_NT: SCORE's (N, T) log-probs, None where SCORE did not compute them;
    values_NT: the critic's (algorithm.advantage=gae), None without one."""
    loss_mask_NT, weight_NT, acc = loss_mask(batch, old_logp_NT, algo)
    scores_N, kl_NT = batch.scores_N, None
    if algo.kl_placement == "reward" and ref_logp_NT is not None:
        kl_NT = kl_estimate(old_logp_NT, ref_logp_NT, algo.kl_estimator, mask_NT=batch.resp_mask_NT)
        acc.add("reward/kl_penalty", kl_coef * kl_NT.sum(), len(batch))
        if not takes_token_kl(algo.advantage):
            # Sequence-level estimators see the KL as a penalty on the score; REINFORCE++
            # takes it per token (KL-to-go in its returns) below.
            scores_N, kl_NT = kl_penalty_rewards(scores_N, kl_NT, batch.resp_mask_NT, kl_coef), None
    returns_NT = None
    if estimator(algo.advantage).critic:
        adv_NT, returns_NT = _gae(batch, scores_N, kl_NT, kl_coef, values_NT, loss_mask_NT, algo, acc)
    else:
        # Token-level estimators whiten over the tokens the loss trains (stats_mask_NT), not the filtered ones.
        adv_NT = _advantages(batch, scores_N, kl_NT, kl_coef, loss_mask_NT, algo)
    acc.add("reward/trained_mean", batch.rewards_N.sum(), len(batch))
    if algo.overlong_penalty_factor > 0:
        acc.add("reward/overlong_penalty", (batch.scores_N - batch.rewards_N).sum(), len(batch))
    train_batch = TrainBatch(
        ids_NL=batch.ids_NL,
        attn_NL=batch.attn_NL,
        mask_NT=loss_mask_NT,
        P=batch.P,
        adv_NT=adv_NT,
        old_logp_NT=old_logp_NT,
        ref_logp_NT=ref_logp_NT,
        weight_NT=weight_NT,
        engine_logp_NT=batch.engine_logp_NT,
        group_size=batch.group_size,
        values_NT=values_NT,
        returns_NT=returns_NT,
    )
    return train_batch, acc


def _advantages(batch: RolloutBatch, scores_N, kl_NT, kl_coef: float, loss_mask_NT, algo: AlgorithmConfig):
    """A critic-free estimator's adv_NT (the table's, algorithms/advantages.py)."""
    return compute_advantages(
        algo.advantage,
        scores_N,
        batch.group_ids_N,
        batch.resp_mask_NT,
        eps=algo.adv_eps,
        gamma=algo.gamma,
        kl_NT=kl_NT,
        kl_coef=kl_coef if kl_NT is not None else 0.0,
        reduce_sum=D.all_reduce_sum,
        stats_mask_NT=loss_mask_NT,
    )


def _gae(batch: RolloutBatch, scores_N, kl_NT, kl_coef: float, values_NT, loss_mask_NT, algo: AlgorithmConfig, acc):
    """PPO with a critic: token rewards (the score on the last generated token, the KL per token when it is in the
    reward), GAE advantages whitened over the trained tokens of every rank, and the returns the critic regresses."""
    if values_NT is None:
        raise ValueError("algorithm.advantage=gae needs the critic's values from SCORE (critic.* configured)")
    rewards_NT = outcome_token_rewards(
        scores_N, batch.resp_mask_NT, kl_NT=kl_NT, kl_coef=kl_coef if kl_NT is not None else 0.0
    )
    adv_NT, returns_NT = gae_advantages_returns(
        rewards_NT,
        values_NT,
        batch.resp_mask_NT,
        algo.gamma,
        algo.lam,
        eps=algo.adv_eps,
        reduce_sum=D.all_reduce_sum,
        stats_mask_NT=loss_mask_NT,
    )
    n_tok = loss_mask_NT.sum()
    acc.add("critic/values_mean", (values_NT * loss_mask_NT).sum(), n_tok)
    acc.add("critic/returns_mean", (returns_NT * loss_mask_NT).sum(), n_tok)
    ev = explained_variance(values_NT, returns_NT, loss_mask_NT, reduce_sum=D.all_reduce_sum)
    acc.add("critic/vf_explained_var", ev)
    return adv_NT, returns_NT


def loss_mask(
    batch: RolloutBatch, old_logp_NT: Optional[torch.Tensor], algo: AlgorithmConfig
) -> tuple[torch.Tensor, Optional[torch.Tensor], MeanAccumulator]:
    """(loss mask, TIS weight or None, metrics): overlong filter, then rollout correction (MIS may mask more)."""
    acc, n = MeanAccumulator(), len(batch)
    loss_mask_NT = batch.resp_mask_NT
    if algo.overlong_filter:
        loss_mask_NT = truncation_mask(batch.truncated_N, loss_mask_NT)
        acc.add("response/overlong_filtered", batch.truncated_N.sum(), n)
    weight_NT = None
    if algo.rollout_correction != "none":
        n_tok = loss_mask_NT.sum()  # the correction's metrics are means over its input mask
        weight_NT, loss_mask_NT, corr = rollout_correction(
            old_logp_NT,
            batch.engine_logp_NT,
            loss_mask_NT,
            algo.rollout_correction,
            algo.correction_cap,
            algo.correction_lower,
        )
        for k, v in sorted(corr.items()):
            if k.endswith("_max"):
                acc.add_max(f"rollout/{k}", v)
            else:
                acc.add(f"rollout/{k}", v * n_tok, n_tok)
        if not algo.rollout_correction.startswith("tis"):
            weight_NT = None  # MIS only masks
    acc.add("response/loss_tokens", loss_mask_NT.sum(), n)
    return loss_mask_NT, weight_NT, acc
