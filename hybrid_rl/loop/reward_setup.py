"""What a run scores with, resolved from `reward.*` and checked before any model loads.

The rule reward (a registry name, `reward.fn`, or a function passed to `Trainer`), the
parts and their weights (combine.py), the reward model's directory, tokenizer and score
(model.py), and the running normaliser of its scores. `probe` calls the rule reward once
and `build_model` loads and probes the reward model, so a broken reward fails before the
first step, not after the first rollout.

`rule_rewards` is the one definition of what a rule reward sees (prompt per completion, the
decoded text without its stop token, metadata = the dataset row + `finish_reason` +
`response_tokens`); the training step (`score`), validation and the start-up probe all go
through it. `score` adds the reward model's part, the weighting and DAPO's soft overlong
penalty.

With an environment (`env.*`, envs/setup.py, held here as `env`), the G samples of a row are episodes
and the `env` part is each episode's summed step rewards; a rule reward, if weighted too, reads the
episode's turns as the environment saw them, one per line (never the observations).

Legend: N completions, row-major: `group_size` per dataset row.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from hybrid_rl.algorithms.dapo import overlong_penalty
from hybrid_rl.config.schema import Config
from hybrid_rl.envs.episodes import EpisodeCompletion
from hybrid_rl.envs.setup import EnvSetup, model_context
from hybrid_rl.rewards.base import RewardFn, compute_rewards, resolve_reward
from hybrid_rl.rewards.combine import RunningNorm, combine, resolve_weights
from hybrid_rl.rewards.model import RewardModelScorer, inspect_reward_model, load_reward_model
from hybrid_rl.types import Completion, response_bodies

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
    # DAPO's soft overlong penalty on the score: (max_new_tokens, buffer, factor); factor 0 = off.
    overlong: tuple[int, int, float] = (1, 0, 0.0)
    module: Optional[torch.nn.Module] = None  # the sharded reward model, once `build_model` loaded it
    scorer: Optional[RewardModelScorer] = None
    env: Optional[EnvSetup] = None  # the episodes' environment (env.*), or None: single-turn completions
    python_fn: Optional[Callable] = None  # the function passed as Trainer(cfg, reward_fn=...), if any

    @classmethod
    def resolve(cls, cfg: Config, reward_fn: Optional[RewardFn] = None) -> "RewardSetup":
        r = cfg.reward
        name, rule = resolve_reward(r.name, r.fn, r.kwargs, r.success_threshold, reward_fn)
        env = EnvSetup.resolve(cfg)
        weights = resolve_weights(r.weights, bool(r.model_path), env is not None)
        if reward_fn is not None and "rule" not in weights:
            raise ValueError(
                f"config key 'reward.weights': a reward_fn was passed to Trainer, but the reward's parts "
                f"are {weights} (no 'rule'); add reward.weights.rule to use it"
            )
        rm_spec, rm_tokenizer = (
            inspect_reward_model(r.model_path, r.score_index, r.score_token, r.score_token_id)
            if r.model_path
            else (None, None)
        )
        if (
            "rule" in weights
            and reward_fn is None
            and not r.fn
            and BUILTIN_REWARDS.get(r.name, cfg.data.task) != cfg.data.task
        ):
            warnings.warn(
                f"reward.name={r.name} is the reward of data.task={BUILTIN_REWARDS[r.name]}, but this run "
                f"trains on data.task={cfg.data.task}; set reward.name to the task's reward"
            )
        a, max_new = cfg.algorithm, cfg.rollout.max_new_tokens
        # DAPO's buffer is a fifth of the maximum length (4096 of 20480); rounded down.
        buffer = a.overlong_buffer_len if a.overlong_buffer_len is not None else max_new // 5
        return cls(
            name=name,
            rule=rule,
            weights=weights,
            rm_spec=rm_spec,
            rm_tokenizer=rm_tokenizer,
            norm=RunningNorm() if r.normalize_model else None,
            max_tokens_per_micro_batch=r.max_tokens_per_micro_batch,
            overlong=(max_new, buffer, a.overlong_penalty_factor),
            env=env,
            python_fn=reward_fn,
        )

    def recorded(self, cfg: Config) -> tuple[Config, str]:
        """(the config as this run used it, a line saying which reward ran): what the run directory's config.yaml
        records. A key the run did not read is blanked where the file still loads: reward.name beside reward.fn,
        and a function passed from Python is recorded as reward.fn=module:qualname."""
        r, w = cfg.reward, self.weights
        used = copy.deepcopy(cfg)
        parts = []
        if "rule" in w:
            if self.python_fn is not None:
                fn = self.python_fn
                where = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
                rule = f"{where} (a Python function passed as Trainer(cfg, reward_fn=...))"
                used.reward.fn, used.reward.name = where, ""
            elif r.fn:
                rule = f"reward.fn={r.fn}"
                used.reward.name = ""
            else:
                rule = f"reward.name={r.name}"
            parts.append(f"rule x {w['rule']:g} = {rule}")
        if "model" in w:
            parts.append(f"model x {w['model']:g} = reward.model_path={r.model_path}")
        if "env" in w:
            env = f"env.name={cfg.env.name}" if cfg.env.name else f"env.fn={cfg.env.fn}"
            parts.append(f"env x {w['env']:g} = the summed step rewards of {env}")
        unused = "" if "rule" in w else " (no rule reward: reward.name and reward.fn below were not used)"
        return used, "reward used: " + "; ".join(parts) + unused

    def rule_rewards(
        self, rows: Sequence[dict], completions: Sequence[Completion], group_size: int, tokenizer, stop_ids: set[int]
    ) -> tuple[list[str], list[float]]:
        """(texts, rule reward per completion) of N = len(rows) * group_size completions, row-major.

        What the reward function sees: completion i belongs to rows[i // group_size]; its text is decoded
        without special tokens and without a final stop token (`response_bodies`)."""
        bodies = response_bodies(completions, stop_ids)
        # (transformers decodes an empty batch as [""])
        texts = tokenizer.batch_decode(bodies, skip_special_tokens=True) if completions else []
        texts = [c.text if isinstance(c, EpisodeCompletion) else t for c, t in zip(completions, texts)]
        prompts = [rows[i // group_size]["prompt"] for i in range(len(completions))]
        meta = [
            {**rows[i // group_size], "finish_reason": c.finish_reason, "response_tokens": len(b)}
            for i, (c, b) in enumerate(zip(completions, bodies))
        ]
        return texts, compute_rewards(self.name, self.rule, prompts, texts, meta)

    def score(
        self,
        rows: Sequence[dict],
        completions: Sequence[Completion],
        group_size: int,
        tokenizer,
        stop_ids: set[int],
        model_phase: Callable[[], ContextManager] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(reward_N, score_N, logged parts) of a training step's completions.

        The rule reward (`rule_rewards`) and/or the reward model's score from the completions' text, with the
        model resident inside `model_phase()` (the REWARD stage), weighted (combine.py); the score adds DAPO's
        soft overlong penalty. Logged parts are empty for a rule-only run (it logs reward/mean alone)."""
        parts = {}
        if "rule" in self.weights:
            parts["rule"] = torch.tensor(self.rule_rewards(rows, completions, group_size, tokenizer, stop_ids)[1])
        if "env" in self.weights:
            parts["env"] = torch.tensor([_episode_reward(c) for c in completions], dtype=torch.float32)
        if self.module is not None:
            # Text, never the policy's ids: the reward model has its own tokenizer (rewards/model.py). The
            # policy's special tokens stay in it (the stop token is already cut), as verl keeps them: a decode
            # that drops them lets "2 3 4 <unk>" pass for a finished "2 3 4", and a policy learns that fast.
            rm_texts = tokenizer.batch_decode(response_bodies(completions, stop_ids), skip_special_tokens=False)
            prompts = [rows[i // group_size]["prompt"] for i in range(len(completions))]
            with model_phase() as rm:
                parts["model"] = self.scorer(rm, prompts, rm_texts)
        rewards_N, logged = combine(parts, self.weights, self.norm)
        logged = logged if self.module is not None or len(parts) > 1 else {}
        max_new, buffer, factor = self.overlong
        if factor == 0:
            return rewards_N, rewards_N, logged
        if self.env is None:
            lengths_N = torch.tensor([len(c.token_ids) for c in completions])
        else:
            lengths_N = torch.tensor(
                [overlong_length(c, max_new, self.env.settings.max_episode_tokens) for c in completions]
            )
        return rewards_N, rewards_N + overlong_penalty(lengths_N, max_new, buffer, factor), logged

    def probe(self, rows: list[dict], tokenizer, model_path: str = "") -> None:
        """Call the rule reward once on placeholder completions (empty, cut at the length limit) of the first two
        rows, so a broken function fails before training; the environment's start-up checks (EnvSetup.probe:
        its factory on the first row, every probed opening prompt within rollout.max_episode_tokens)."""
        if self.env is not None:
            self.env.probe(rows, tokenizer, model_context(model_path) if model_path else None)
        if "rule" not in self.weights:
            return  # a run on the reward model alone never calls it (its rows may lack what it reads)
        rows = rows[:2]
        self.rule_rewards(rows, [Completion([], [], "length") for _ in rows], 1, tokenizer, set())

    def build_model(
        self, probe_rows: list[dict], device: torch.device, mixed: bool, mesh=None, whole: bool = False
    ) -> None:
        """Load reward.model_path (sharded, frozen) into `module` and its `scorer`, if the run has one; probed once
        on placeholder completions (every rank that holds a shard: the forward is a collective), so a model that
        scores NaN fails before training. mesh / whole: where a split run's rollout ranks hold it
        (load_reward_model; split/roles.py load_rollout_models)."""
        if self.rm_spec is None:
            return
        module = load_reward_model(self.rm_spec, device, bf16=mixed, mesh=mesh, whole=whole)
        scorer = RewardModelScorer(self.rm_spec, self.rm_tokenizer, device, self.max_tokens_per_micro_batch)
        scorer(module, [r["prompt"] for r in probe_rows], ["" for _ in probe_rows])
        self.module, self.scorer = module, scorer


def overlong_length(c: Completion, max_new_tokens: int, max_episode_tokens: int) -> int:
    """An episode's length as DAPO's soft overlong penalty reads it. An episode is cut at
    rollout.max_episode_tokens (prompt, turns and observations: the tool results its calls asked for count), so
    the penalty ramps on the room left before that cut, exactly as a single completion's ramps on the room left
    before max_new_tokens: the length passed is max_new_tokens - room, so the buffer's last tokens before the
    cut cost up to the full factor. Neither max_new_tokens per turn (a turn cut there goes on to the next) nor
    the generated tokens alone (observations would fill the budget unseen) says how close the episode came to
    being cut; the max_turns cut has no length and is left to the overlong filter (finish_reason "length")."""
    ep = c.episode if isinstance(c, EpisodeCompletion) else None
    if ep is None:
        raise ValueError("an environment is set, but a completion is no episode (loop/reward_setup.py overlong_length)")
    return max_new_tokens - (max_episode_tokens - len(ep.token_ids))


def _episode_reward(c: Completion) -> float:
    if not isinstance(c, EpisodeCompletion) or c.episode is None:
        raise ValueError("reward.weights has an 'env' part, but a completion is no episode; set env.name or env.fn")
    return c.episode.reward
