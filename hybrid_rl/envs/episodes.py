"""Multi-turn episodes over any rollout engine: tokens in, tokens out, observations masked from the loss.

Legend: B dataset rows, G episodes per row (a GRPO group), N = B*G episodes, row-major.

An episode's sequence is the prompt ids, then for each turn the ids the engine sampled (stop
token included) and the observation's ids (data/chat_delta.py: the template's delta, earlier
tokens never change). `loss_mask` is 1 exactly on the sampled ids; `logprobs` holds the engine's
log-prob for each of them (0.0 under observation tokens). The model's text is decoded only to
hand it to the environment; it is never encoded again.

Each turn every live episode goes to the engine in ONE `generate` call (per-episode token
budgets are met by cutting a longer sample, which keeps the kept tokens exactly as sampled);
the environments then step on host threads (step_pool.py), each bounded by `timeout_s`.
How an episode ends (`end`) and what the overlong rules read (`finish_reason`, as a Completion's):

    end                  the environment said done    finish_reason "stop" (or "length" if that turn was cut)
    max_turns            rollout.max_turns turns, not done                       "length"
    max_episode_tokens   no room for the next observation or generated token     "length"
    timeout              a step ran past env.timeout_s (counted; nothing hangs)   "length"

"length" marks the episode truncated (RolloutBatch.truncated_N), so DAPO's overlong filter drops
it from the loss; the soft penalty ramps on the room left before the max_episode_tokens cut
(loop/reward_setup.py overlong_length), as a single completion's does before max_new_tokens.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from hybrid_rl.data.chat_delta import ChatDeltaError, observation_ids, prompt_ids
from hybrid_rl.envs.base import EnvError, EnvFactory, as_step, check_messages, make_env
from hybrid_rl.envs.step_pool import TIMED_OUT, StepPool
from hybrid_rl.types import Completion, SamplingParams

ENDS = ("done", "max_turns", "max_episode_tokens", "timeout")
_TURN_SEED_STRIDE = 1_000_003  # each turn's engine call gets its own seed, so turns do not replay one stream


@dataclass
class EpisodeSettings:
    max_turns: int = 4  # rollout.max_turns
    max_episode_tokens: int = 1024  # rollout.max_episode_tokens: prompt + every turn + every observation
    timeout_s: float = 30.0  # env.timeout_s, per step
    max_workers: int = 16  # env steps run at once

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"config key 'rollout.max_turns': must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 2:
            raise ValueError(f"config key 'rollout.max_episode_tokens': must be >= 2, got {self.max_episode_tokens}")
        if not self.timeout_s > 0:
            raise ValueError(f"config key 'env.timeout_s': must be > 0, got {self.timeout_s}")


@dataclass
class Episode:
    row_index: int
    sample: int  # its place in the row's group, 0..G-1
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # every turn and observation after the prompt
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the engine
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 on observation tokens
    reward: float = 0.0  # the sum of the steps' rewards
    turns: int = 0
    end: str = ""
    finish_reason: str = ""
    turn_texts: list[str] = field(default_factory=list)  # each turn as decoded for the environment
    messages: list[dict] = field(default_factory=list)  # the conversation as the environment saw it
    env_metrics: Counter = field(default_factory=Counter)
    observation_tokens: int = 0
    last_turn_closed: bool = False  # the latest turn ended with a stop token (else its <end> is an observation token)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def as_completion(self) -> "EpisodeCompletion":
        """The episode in the single-turn batch's terms (RolloutBatch.build), carrying its `loss_mask`."""
        return EpisodeCompletion(
            list(self.response_ids),
            list(self.logprobs),
            self.finish_reason,
            loss_mask=list(self.loss_mask),
            episode=self,
        )

    def where(self) -> str:
        return f"episode of row {self.row_index} (sample {self.sample}), turn {self.turns}"


@dataclass
class EpisodeCompletion(Completion):
    """An episode as a Completion (token_ids: every turn and observation after the prompt) that carries its
    loss mask (1 = sampled by the engine) through the group collector to RolloutBatch.build."""

    loss_mask: list[int] = field(default_factory=list)
    episode: Optional[Episode] = None

    @property
    def text(self) -> str:
        """What a rule reward reads: the turns as the environment saw them, one per line (never the observations)."""
        return "\n".join(self.episode.turn_texts) if self.episode is not None else ""

    @property
    def generated_tokens(self) -> int:
        """The tokens of its turns (loss mask 1), not the observations between them."""
        return sum(self.loss_mask)

    @property
    def truncated(self) -> bool:
        """Cut by the runner (max_turns, max_episode_tokens, a timeout), not ended by the environment's done. An
        episode the environment ended keeps finish_reason "length" when its last turn was cut (the overlong rules
        read that), but it ended as the environment decides, which is what a user reads `truncated` for."""
        return self.episode.end != "done" if self.episode is not None else self.finish_reason == "length"


class EpisodeRunner:
    """Runs the G episodes of each row to their end; one object per run (it owns the step threads)."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        factory: EnvFactory,
        env_name: str,
        settings: EpisodeSettings,
        end_text: Optional[str] = None,
    ):
        self.engine, self.tokenizer, self.factory, self.env_name = engine, tokenizer, factory, env_name
        self.settings, self.end_text = settings, end_text
        self.pool = StepPool(settings.max_workers)

    def run(self, rows: Sequence[dict], group_size: int, params: SamplingParams) -> list[Episode]:
        """N = len(rows) * group_size episodes, row-major; the environments are made fresh for each."""
        episodes, envs = self._start(rows, group_size)
        live = list(range(len(episodes)))
        turn = 0
        while live:
            self._generate(turn, params, [episodes[i] for i in live])
            results = self.pool.run(self._step, [(envs[i], episodes[i]) for i in live], self.settings.timeout_s)
            live = [i for i, result in zip(live, results) if self._advance(episodes[i], result)]
            turn += 1
        for ep, env in zip(episodes, envs):
            read = getattr(env, "metrics", None)  # optional: counts such as tool calls (envs/tools.py)
            if callable(read):
                ep.env_metrics.update({k: float(v) for k, v in read().items()})
        return episodes

    def _start(self, rows: Sequence[dict], group_size: int) -> tuple[list[Episode], list[Any]]:
        episodes, envs = [], []
        for r, row in enumerate(rows):
            for g in range(group_size):
                ep = Episode(r, g, [])
                env = make_env(self.factory, row, self.env_name, ep.where())
                try:
                    opening = env.reset(row)
                except Exception as err:
                    raise EnvError(
                        f"environment {self.env_name!r}: reset() raised {type(err).__name__}: {err} ({ep.where()})"
                    ) from err
                ep.messages = check_messages(opening, "reset()", self.env_name, ep.where())
                ep.prompt_ids = prompt_ids(self.tokenizer, ep.messages)
                if len(ep.prompt_ids) >= self.settings.max_episode_tokens:
                    raise ValueError(
                        f"config key 'rollout.max_episode_tokens': {self.settings.max_episode_tokens} "
                        f"leaves no room to generate after the {len(ep.prompt_ids)}-token prompt of "
                        f"row {r}; raise it above the longest prompt"
                    )
                episodes.append(ep)
                envs.append(env)
        return episodes, envs

    def _generate(self, turn: int, params: SamplingParams, live: list[Episode]) -> None:
        """One engine call for every live episode's next turn; each keeps at most its own token budget."""
        budgets = [min(params.max_new_tokens, self.settings.max_episode_tokens - len(ep.token_ids)) for ep in live]
        call = dataclasses.replace(params, max_new_tokens=max(budgets), seed=params.seed + _TURN_SEED_STRIDE * turn)
        completions = self.engine.generate(prompt_ids=[ep.token_ids for ep in live], params=call)
        if len(completions) != len(live):
            raise RuntimeError(f"the engine returned {len(completions)} completions for {len(live)} episodes")
        stop_ids = {self.tokenizer.eos_token_id, *params.stop_token_ids}
        for ep, c, budget in zip(live, completions, budgets):
            ids, logps, reason = list(c.token_ids), list(c.logprobs), c.finish_reason
            if len(ids) > budget:  # the shared call's limit exceeds this episode's room: cut, as sampled
                ids, logps, reason = ids[:budget], logps[:budget], "length"
            closed = reason == "stop" and bool(ids) and ids[-1] in stop_ids
            body = ids[:-1] if closed else ids
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            ep.response_ids += ids
            ep.loss_mask += [1] * len(ids)
            ep.logprobs += logps
            ep.turns += 1
            ep.turn_texts.append(text)
            ep.messages.append({"role": "assistant", "content": text})
            ep.last_turn_closed = closed

    @staticmethod
    def _step(env: Any, ep: Episode) -> Any:
        return env.step(ep.turn_texts[-1])

    def _advance(self, ep: Episode, result: Any) -> bool:
        """Apply one step's result; True if the episode goes on to another turn."""
        closed = ep.last_turn_closed
        if result is TIMED_OUT:
            return self._finish(ep, "timeout", "length")
        if isinstance(result, BaseException):
            raise EnvError(
                f"environment {self.env_name!r}: step() raised {type(result).__name__}: {result} ({ep.where()})"
            ) from result
        step = as_step(result, self.env_name, ep.where())
        ep.reward += step.reward
        if step.done:
            return self._finish(ep, "done", "stop" if closed else "length")
        if ep.turns >= self.settings.max_turns:
            return self._finish(ep, "max_turns", "length")
        try:
            delta = observation_ids(self.tokenizer, ep.messages, step.observation, closed, self.end_text)
        except ChatDeltaError as err:
            raise ChatDeltaError(f"{err} ({ep.where()}, environment {self.env_name!r})") from err
        if len(ep.token_ids) + len(delta) >= self.settings.max_episode_tokens:
            return self._finish(ep, "max_episode_tokens", "length")  # no room to answer it: dropped
        ep.messages += step.observation
        ep.response_ids += delta
        ep.loss_mask += [0] * len(delta)
        ep.logprobs += [0.0] * len(delta)
        ep.observation_tokens += len(delta)
        return True

    def _finish(self, ep: Episode, end: str, finish_reason: str) -> bool:
        ep.end, ep.finish_reason = end, finish_reason
        return False


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means per episode (turns, tokens, tool counts) and the fraction ending each way."""
    n = max(1, len(episodes))
    out = {
        "episode/turns": sum(e.turns for e in episodes) / n,
        "episode/tokens": sum(len(e.token_ids) for e in episodes) / n,
        "episode/generated_tokens": sum(sum(e.loss_mask) for e in episodes) / n,
        "episode/observation_tokens": sum(e.observation_tokens for e in episodes) / n,
        "episode/reward": sum(e.reward for e in episodes) / n,
    }
    keys = sorted({k for e in episodes for k in e.env_metrics})
    out.update({f"episode/{k}": sum(e.env_metrics.get(k, 0.0) for e in episodes) / n for k in keys})
    out.update({f"episode/end_{k}": sum(e.end == k for e in episodes) / n for k in ENDS})
    return out
