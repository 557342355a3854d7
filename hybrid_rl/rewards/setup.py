"""What a run scores with, resolved from `reward.*` and checked before any model loads.

The rule reward (a registry name, `reward.fn`, or a function passed to `Trainer`), the
parts and their weights (combine.py), the reward model's directory, tokenizer and score
(model.py), and the running normaliser of its scores. `probe` calls the rule reward once
and `build_model` loads and probes the reward model, so a broken reward fails before the
first step, not after the first rollout.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hybrid_rl.config import Config
from hybrid_rl.rewards.base import RewardFn, compute_rewards, resolve_reward
from hybrid_rl.rewards.combine import RunningNorm, resolve_weights
from hybrid_rl.rewards.model import RewardModelScorer, inspect_reward_model, load_reward_model

# Built-in rewards and the built-in task each one scores (a mismatch is almost always a config slip).
BUILTIN_REWARDS = {"digits": "digits", "gsm8k": "gsm8k", "gsm8k_format": "gsm8k"}


@dataclass
class RewardSetup:
    name: str  # the rule reward's display name
    rule: Any  # its RewardSpec (rewards/base.py)
    weights: dict[str, float]  # the parts computed, e.g. {"rule": 1.0, "model": 0.5}
    rm_spec: Any  # the reward model's RewardModelSpec, or None
    rm_tokenizer: Any
    norm: Optional[RunningNorm]  # running mean/std of the model's scores (reward.normalize_model)
    max_tokens_per_micro_batch: int

    @classmethod
    def resolve(cls, cfg: Config, reward_fn: Optional[RewardFn] = None) -> "RewardSetup":
        r = cfg.reward
        name, rule = resolve_reward(r.name, r.fn, r.kwargs, r.success_threshold, reward_fn)
        weights = resolve_weights(r.weights, bool(r.model_path))
        if reward_fn is not None and "rule" not in weights:
            raise ValueError(f"config key 'reward.weights': a reward_fn was passed to Trainer, but the reward's parts "
                             f"are {weights} (no 'rule'); add reward.weights.rule to use it")
        rm_spec, rm_tokenizer = (inspect_reward_model(r.model_path, r.score_index, r.score_token, r.score_token_id)
                                 if r.model_path else (None, None))
        if ("rule" in weights and reward_fn is None and not r.fn
                and BUILTIN_REWARDS.get(r.name, cfg.data.task) != cfg.data.task):
            warnings.warn(f"reward.name={r.name} is the reward of data.task={BUILTIN_REWARDS[r.name]}, but this run "
                          f"trains on data.task={cfg.data.task}; set reward.name to the task's reward")
        return cls(name=name, rule=rule, weights=weights, rm_spec=rm_spec, rm_tokenizer=rm_tokenizer,
                   norm=RunningNorm() if r.normalize_model else None,
                   max_tokens_per_micro_batch=r.max_tokens_per_micro_batch)

    def probe(self, rows: list[dict]) -> None:
        """Call the rule reward once on placeholder completions, so a broken function fails before training."""
        if "rule" not in self.weights:
            return  # a run on the reward model alone never calls it (its rows may lack what it reads)
        meta = [{**r, "finish_reason": "length", "response_tokens": 0} for r in rows]
        compute_rewards(self.name, self.rule, [r["prompt"] for r in rows], ["" for _ in rows], meta)

    def build_model(self, probe_rows: list[dict], device: torch.device, mixed: bool):
        """(sharded frozen module, scorer) of reward.model_path, or (None, None); probed once on placeholder
        completions (every rank: the forward is a collective), so a model that scores NaN fails before training."""
        if self.rm_spec is None:
            return None, None
        module = load_reward_model(self.rm_spec, device, bf16=mixed)
        scorer = RewardModelScorer(self.rm_spec, self.rm_tokenizer, device, self.max_tokens_per_micro_batch)
        scorer(module, [r["prompt"] for r in probe_rows], ["" for _ in probe_rows])
        return module, scorer
