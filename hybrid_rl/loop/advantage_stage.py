"""The ADVANTAGE stage: from a scored `RolloutBatch` to the `TrainBatch` the update trains on.

    loss mask   the response tokens, less truncated completions (DAPO's overlong filter) and
                the tokens rollout correction masks (MIS); TIS gives a per-token weight instead
    KL          with the KL placed in the reward, the per-token KL to the reference: a penalty
                on the score for sequence-level estimators, per token for those that take it
                (`takes_token_kl`, REINFORCE++'s KL-to-go)
    advantages  of this rank's groups, whitening statistics over all ranks (`D.all_reduce_sum`)

Pure of the Trainer: a batch, its log-probs, the step's KL coefficient and the algorithm's
config in; the train batch and its metrics out. Legend: N sequences on this rank, T response tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid_rl.algorithms.advantages import compute_advantages, takes_token_kl
from hybrid_rl.algorithms.correction import rollout_correction
from hybrid_rl.algorithms.dapo import truncation_mask
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
) -> tuple[TrainBatch, MeanAccumulator]:
    """Loss mask and correction weight, KL in the reward, advantages: the batch the update trains on, and the
    stage's metrics. old/ref_logp_NT: SCORE's (N, T) log-probs, None where SCORE did not compute them."""
    loss_mask_NT, weight_NT, acc = loss_mask(batch, old_logp_NT, algo)
    scores_N, kl_NT = batch.scores_N, None
    if algo.kl_placement == "reward" and ref_logp_NT is not None:
        kl_NT = kl_estimate(old_logp_NT, ref_logp_NT, algo.kl_estimator, mask_NT=batch.resp_mask_NT)
        acc.add("reward/kl_penalty", kl_coef * kl_NT.sum(), len(batch))
        if not takes_token_kl(algo.advantage):
            # Sequence-level estimators see the KL as a penalty on the score; REINFORCE++
            # takes it per token (KL-to-go in its returns) below.
            scores_N, kl_NT = kl_penalty_rewards(scores_N, kl_NT, batch.resp_mask_NT, kl_coef), None
    # Token-level estimators whiten over the tokens the loss trains (stats_mask_NT), not the filtered ones.
    adv_NT = compute_advantages(
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
    )
    return train_batch, acc


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
