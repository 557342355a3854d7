"""A run's environment, resolved from `env.*` and `rollout.max_turns` / `rollout.max_episode_tokens`, and
checked at start-up, before the first step: the factory imports (`env.fn`) or is registered (`env.name`),
the tokenizer has a chat template (an environment speaks in chat messages), the factory is probed on the
first dataset row (what it makes has reset and step; reset returns messages), and
`rollout.max_episode_tokens` lies between the longest opening prompt and the model's context.

The rollout stage (loop/rollout_stage.py) asks `runner(engine, tokenizer)` for the episode runner; one runner,
and so one pool of step threads, serves the whole run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from hybrid_rl.config.schema import Config
from hybrid_rl.data.chat_delta import prompt_ids, require_chat_template
from hybrid_rl.envs.base import EnvError, EnvSpec, check_messages, make_env, resolve_env
from hybrid_rl.envs.episodes import EpisodeRunner, EpisodeSettings

PROBE_ROWS = 256  # rows whose opening prompts are measured against max_episode_tokens at start-up


@dataclass
class EnvSetup:
    name: str  # the environment's display name (env.name or env.fn)
    spec: EnvSpec
    settings: EpisodeSettings
    longest_prompt: int = 0  # tokens of the longest opening prompt probed (probe)
    _runner: Optional[EpisodeRunner] = field(default=None, repr=False)

    @classmethod
    def resolve(cls, cfg: Config) -> Optional["EnvSetup"]:
        """The run's environment, or None for single-turn completions (no env.name, no env.fn)."""
        if not cfg.env.enabled:
            return None
        name, spec = resolve_env(cfg.env.name, cfg.env.fn)
        r, e = cfg.rollout, cfg.env
        return cls(name, spec, EpisodeSettings(r.max_turns, r.max_episode_tokens, e.timeout_s, e.max_workers))

    def probe(self, rows: Sequence[dict], tokenizer: Any, context: Optional[int]) -> None:
        """Make an environment for each of the first rows (the first is the factory's probe), reset it, and
        check its opening prompt fits `rollout.max_episode_tokens`, which must fit `context` (None: unknown)."""
        limit = self.settings.max_episode_tokens
        if context and limit > context:
            raise ValueError(
                f"config key 'rollout.max_episode_tokens': {limit} is above the model's context of "
                f"{context} tokens (max_position_embeddings); lower it"
            )
        require_chat_template(tokenizer, f"environment {self.name!r}'s messages")
        for i, row in enumerate(rows[:PROBE_ROWS]):
            where = f"start-up probe, row {i}"
            env = make_env(self.spec.factory, row, self.name, where)
            try:
                opening = env.reset(row)
            except Exception as err:
                raise EnvError(
                    f"environment {self.name!r}: reset() raised {type(err).__name__}: {err} ({where})"
                ) from err
            n = len(prompt_ids(tokenizer, check_messages(opening, "reset()", self.name, where)))
            if n >= limit:
                raise ValueError(
                    f"config key 'rollout.max_episode_tokens': {limit} leaves no room to generate after "
                    f"the {n}-token opening prompt of row {i} (environment {self.name!r}); raise it "
                    "above the longest prompt"
                )
            self.longest_prompt = max(self.longest_prompt, n)

    def runner(self, engine: Any, tokenizer: Any) -> EpisodeRunner:
        """The run's episode runner for `engine` (made once; its step threads are reused every step)."""
        if self._runner is None or self._runner.engine is not engine:
            self._runner = EpisodeRunner(engine, tokenizer, self.spec.factory, self.name, self.settings)
        return self._runner


def model_context(model_path: str) -> Optional[int]:
    """max_position_embeddings of the model's config.json (None when absent)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("max_position_embeddings")
