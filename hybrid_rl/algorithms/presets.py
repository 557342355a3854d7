"""Named algorithm presets: the published settings of each method, as plain values.

A preset is a function returning a dict of `algorithm.*` config keys (no config
object here; `config/schema.py` layers these values). Each preset names the whole
algorithm (advantage, loss, aggregation, clipping, KL, entropy, DAPO tricks) so
that selecting one over a YAML that sets some of those keys gives that method,
not a mix. Batch shape (ppo_epochs, mini_batch_size), the sampling budget
(max_sampling_rounds) and rollout correction are left to the user: they depend
on the hardware and the engine, not on the method.

Selection (see `config.load.load_config`): `algorithm.preset=dapo` expands to these
keys in the layer that names it; keys set explicitly in that layer or a later
one (YAML < command line) still win.

LOSS_CLIP_DEFAULTS holds the clip bounds each policy loss uses when
`algorithm.clip_ratio_low/high` are left at "auto".
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["PRESETS", "LOSS_CLIP_DEFAULTS", "preset_values", "grpo", "drgrpo", "dapo", "gspo"]

# (clip_ratio_low, clip_ratio_high) per policy loss; None disables that side.
LOSS_CLIP_DEFAULTS: dict[str, tuple[Optional[float], Optional[float]]] = {
    "ppo_clip": (0.2, 0.2),  # Schulman et al. 2017
    "gspo": (3e-4, 4e-4),  # Zheng et al. 2025, Sec. 5.1 (sequence-level ratios are close to 1)
    "cispo": (None, 0.2),  # MiniMax 2025: the IS weight is clipped from above only
}

_NO_DAPO = {"dynamic_sampling": False, "overlong_filter": False, "overlong_penalty_factor": 0.0}
# kl_coef 0 is what turns the KL off (and the reference model with it); the placement
# stays "loss" so that `algorithm.kl_coef=...` on top of such a preset does what it says.
_NO_KL = {"kl_placement": "loss", "kl_coef": 0.0, "kl_estimator": "k3", "kl_controller": "fixed"}


def grpo() -> dict[str, Any]:
    """GRPO as in Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical
    Reasoning in Open Language Models" (arXiv:2402.03300), Sec. 4.1.

    Group-normalised advantages (r - mean) / std, PPO clip eps = 0.2, the loss
    averaged over tokens of a sequence then over sequences (Eq. 3), and the
    unbiased k3 KL estimator to the reference added to the loss with beta = 0.04.
    """
    return {
        "advantage": "grpo",
        "policy_loss": "ppo_clip",
        "loss_agg": "seq-mean-token-mean",
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": None,
        "kl_placement": "loss",
        "kl_coef": 0.04,
        "kl_estimator": "k3",
        "kl_controller": "fixed",
        "entropy_coef": 0.0,
        **_NO_DAPO,
    }


def drgrpo() -> dict[str, Any]:
    """Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective" (arXiv:2503.20783), Sec. 3.1.

    Removes GRPO's two biases: no division by the group std (advantage r - mean)
    and no division by the response length (token sums divided by a constant,
    the maximum response length: seq-mean-token-sum-norm). No KL term.
    """
    return {
        "advantage": "drgrpo",
        "policy_loss": "ppo_clip",
        "loss_agg": "seq-mean-token-sum-norm",
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": None,
        **_NO_KL,
        "entropy_coef": 0.0,
        **_NO_DAPO,
    }


def dapo() -> dict[str, Any]:
    """DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
    at Scale" (arXiv:2503.14476), Sec. 3.

    Clip-higher (eps_low 0.2, eps_high 0.28), dynamic sampling (groups whose
    rewards are all equal are dropped and more prompts are sampled), token-level
    loss (token-mean), overlong filtering (truncated samples leave the loss) and
    the soft overlong punishment with factor 1.0 over a buffer of a fifth of the
    maximum length (the paper's 4096 of 20480 tokens; overlong_buffer_len=null
    means that fifth). No KL term, GRPO group-normalised advantages.
    """
    return {
        "advantage": "grpo",
        "policy_loss": "ppo_clip",
        "loss_agg": "token-mean",
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": None,
        **_NO_KL,
        "entropy_coef": 0.0,
        "dynamic_sampling": True,
        "overlong_filter": True,
        "overlong_penalty_factor": 1.0,
        "overlong_buffer_len": None,
    }


def gspo() -> dict[str, Any]:
    """GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).

    Sequence-level importance ratio (length-normalised), clipped per sequence
    with the paper's small ranges (3e-4 below, 4e-4 above), sequence-mean
    aggregation (its GSPO-token form with seq-mean-token-mean has exactly the
    sequence-level gradient), group-normalised advantages, no KL term. The
    paper splits each rollout batch into 4 mini-batches: set
    algorithm.mini_batch_size for that (the ratio is 1 on the first one).
    """
    return {
        "advantage": "grpo",
        "policy_loss": "gspo",
        "loss_agg": "seq-mean-token-mean",
        "clip_ratio_low": 3e-4,
        "clip_ratio_high": 4e-4,
        "clip_ratio_c": None,
        **_NO_KL,
        "entropy_coef": 0.0,
        **_NO_DAPO,
    }


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {"grpo": grpo, "drgrpo": drgrpo, "dapo": dapo, "gspo": gspo}


def preset_values(name: str) -> dict[str, Any]:
    """The `algorithm.*` keys of preset `name` (a fresh dict); ValueError lists the valid names."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]()
