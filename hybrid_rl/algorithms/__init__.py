"""RL algorithm building blocks: pure functions on tensors (no model, no I/O).

advantages   outcome-reward advantage estimators (GRPO, Dr. GRPO, RLOO; token-level REINFORCE++) and their table
returns      REINFORCE++'s token rewards and discounted returns
gae          PPO with a critic: outcome token rewards, GAE advantages / returns, clipped value loss
whitening    whitening over the valid tokens of every rank
losses       per-token policy losses (PPO-clip / dual clip, GSPO, CISPO)
aggregation  loss aggregation with a global normaliser (DP / grad-accum invariant)
kl           KL estimators, KL controllers, reward-side KL penalty
correction   rollout-engine vs trainer mismatch correction (TIS / MIS)
dapo         DAPO dynamic-sampling filter, overlong penalty and filtering
"""

from hybrid_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_LEVEL_ESTIMATORS,
    AdvantageInputs,
    Estimator,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    takes_token_kl,
)
from hybrid_rl.algorithms.aggregation import (
    LOSS_AGG_MODES,
    aggregate_loss,
    masked_sum,
    normalizer_count,
)
from hybrid_rl.algorithms.correction import CORRECTION_MODES, rollout_correction
from hybrid_rl.algorithms.dapo import filter_groups, overlong_penalty, truncation_mask
from hybrid_rl.algorithms.gae import explained_variance, gae_advantages_returns, outcome_token_rewards, value_loss
from hybrid_rl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalty_rewards,
)
from hybrid_rl.algorithms.losses import (
    POLICY_LOSSES,
    cispo_loss,
    compute_policy_loss,
    gspo_loss,
    ppo_clip_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "TOKEN_LEVEL_ESTIMATORS",
    "AdvantageInputs",
    "Estimator",
    "takes_token_kl",
    "compute_advantages",
    "grpo_advantages",
    "drgrpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "LOSS_AGG_MODES",
    "normalizer_count",
    "aggregate_loss",
    "masked_sum",
    "KL_ESTIMATORS",
    "kl_estimate",
    "FixedKLController",
    "AdaptiveKLController",
    "kl_penalty_rewards",
    "POLICY_LOSSES",
    "compute_policy_loss",
    "ppo_clip_loss",
    "gspo_loss",
    "cispo_loss",
    "CORRECTION_MODES",
    "rollout_correction",
    "filter_groups",
    "overlong_penalty",
    "truncation_mask",
    "outcome_token_rewards",
    "gae_advantages_returns",
    "value_loss",
    "explained_variance",
]
