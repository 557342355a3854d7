"""The ROLLOUT and REWARD stages of a step: this rank's prompts x G samples through the engine, each
completion scored, until the collector holds the step's groups (dynamic sampling may need several
rounds); the kept groups as one `RolloutBatch`.

Pure of the Trainer: built from the config, the prompt encoder, the reward setup and the tokenizer,
and run with the engine the ROLLOUT phase hands out, the run state's prompt loader and the step's
index. With an environment (`env.*`, envs/setup.py) each row's G samples are G multi-turn episodes
(envs/episodes.py), run through the same engine instead of one generate call; an episode then
reaches the batch as one completion whose loss mask is 0 on observation tokens. A second loop reuses
it as it is: the split placement's rollout ranks run the same stage (their own loader slice) and send the
batch's groups to the learner ranks.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Callable, Optional

import torch

from hybrid_rl.batch import RolloutBatch
from hybrid_rl.config.schema import Config
from hybrid_rl.data.prompts import PromptLoader
from hybrid_rl.envs.episodes import EpisodeCompletion, episode_metrics
from hybrid_rl.loop.dynamic_sampling import GroupCollector
from hybrid_rl.loop.partial import PartialRollouts, stale_advice
from hybrid_rl.loop.reward_setup import RewardSetup
from hybrid_rl.observability.loggers import log_rollouts
from hybrid_rl.observability.metrics import MeanAccumulator, StageTimer
from hybrid_rl.runtime import distributed as D
from hybrid_rl.types import Completion, SamplingParams, response_bodies


class RolloutStage:
    def __init__(
        self,
        cfg: Config,
        encode: Callable[[dict], list[int]],
        rewards: RewardSetup,
        tokenizer,
        stop_token_ids: tuple[int, ...],
        stop_set: set,
        device,
        out_dir: str,
    ):
        """stop_token_ids: what every engine stops on; stop_set: a completion's last token that is cut
        from its text (trainer._build_data); out_dir: where `trainer.log_rollouts` writes rollouts.jsonl."""
        self.cfg, self.encode, self.rewards, self.tokenizer = cfg, encode, rewards, tokenizer
        self.stop_token_ids, self.stop_set, self.device, self.out_dir = stop_token_ids, stop_set, device, out_dir
        self.env = rewards.env  # envs/setup.py's EnvSetup, or None: single-turn completions
        self.last_token_versions: list[list[int]] = []  # run_partial's, per completion of its batch
        self.said_stale = False  # run_partial warns once per run when the staleness rule drops carried samples

    def run(
        self, engine, loader: PromptLoader, step: int, timer: StageTimer, model_phase=None
    ) -> tuple[Optional[RolloutBatch], dict]:
        """Sampling rounds until the collector has the step's groups; the kept groups as one batch (None if
        none) and the stage's metrics. step: finished steps (seeds the sampling); model_phase: the phase
        switch's reward() context, for a reward model (RewardSetup.score)."""
        algo, G = self.cfg.algorithm, self.cfg.rollout.n
        groups = GroupCollector(G, algo.dynamic_sampling, algo.max_sampling_rounds, self.rewards.rule.success_threshold)
        episodes = MeanAccumulator()
        engine = CallTally(engine)  # the step's tokens and tail over every call: rounds, and an episode's turns
        while True:
            rows = loader.next_batch()
            with timer("rollout"):
                prompt_ids, completions = self.generate(
                    engine, rows, self.sampling_params(step, groups.rounds), episodes
                )
            with timer("reward"):
                rewards_N, scores_N, parts = self.score(rows, completions, model_phase)
            groups.add(rows, prompt_ids, completions, rewards_N, scores_N, parts)
            if not groups.need_another_round():
                break
        kept, metrics = groups.finish()
        if self.env is not None:
            metrics.update(reduce_episode_metrics(episodes))
        metrics.update(engine_metrics(engine))
        return self._batch(kept, metrics, step)

    def run_partial(
        self,
        engine,
        pool: PartialRollouts,
        loader: PromptLoader,
        step: int,
        timer: StageTimer,
        model_phase=None,
        version: Optional[int] = None,
    ) -> tuple[Optional[RolloutBatch], dict]:
        """rollout.partial (loop/partial.py): stale groups dropped, the pool refilled, one engine call that stops
        once enough groups are done; the oldest complete groups (as many on every rank) scored and batched, the
        rest carried in `pool`. step: the batch's index, trained at version `step`; version: the weights the engine
        holds (colocated: `step`; a split rollout rank's may be older). `last_token_versions` then holds the
        version of every token of the batch's completions, in their order."""
        G = self.cfg.rollout.n
        version = step if version is None else version
        dropped_groups, dropped = pool.drop_stale(step, self.cfg.trainer.max_staleness)
        pool.refill(step, loader, self.encode)
        plan = pool.plan()
        with timer("rollout"):
            # Called even with no rows or no group needed (the engine then decodes nothing): an engine group of
            # tp_size ranks gathers every rank's rows in its call, so each rank must make it.
            budget = max(plan.request.max_new_tokens, default=self.cfg.rollout.max_new_tokens)
            params = replace(self.sampling_params(step, 0), max_new_tokens=budget)
            completions = engine.generate(plan.prompt_ids, params, plan.request)
            pool.absorb(plan, completions, version, engine.last_kept_kv if pool.keep_kv else None)
        # The plan's request holds the caches the call replaced (rollout.partial_kv=keep): only its counts outlive it.
        continued, n_kept, cut = plan.continued, plan.kept, plan.cut
        del plan
        n = -int(D.all_reduce_max(torch.tensor([-pool.complete_count()], dtype=torch.int64)).item())
        taken = pool.take(n)
        rows, prompt_ids = [g.row for g in taken], [g.prompt_ids for g in taken]
        trained = [s for g in taken for s in g.samples]
        completions = [s.completion() for s in trained]
        self.last_token_versions = [list(s.versions) for s in trained]
        with timer("reward"):
            rewards_N, scores_N, parts = self.score(rows, completions, model_phase)
        groups = GroupCollector(G, False, 1, self.rewards.rule.success_threshold)
        groups.want = pool.batch_groups
        groups.add(rows, prompt_ids, completions, rewards_N, scores_N, parts)
        kept, metrics = groups.finish()
        spans = [s.versions[-1] - s.versions[0] for s in trained if s.versions]
        totals = D.all_reduce_sum(
            torch.tensor(
                [
                    pool.carried_samples(),
                    continued,
                    dropped,
                    dropped_groups,
                    cut,
                    sum(spans),
                    len(spans),
                    n_kept,
                ],
                dtype=torch.float64,
            )
        ).tolist()
        span_max = D.all_reduce_max(torch.tensor([max(spans, default=0)], dtype=torch.int64)).item()
        if totals[2] and not self.said_stale:
            self.said_stale = True
            if D.rank() == 0:  # of the scope: a split run's first rollout rank, else global rank 0
                warnings.warn(stale_advice(int(totals[2]), step, self.cfg.trainer.max_staleness), stacklevel=2)
        metrics.update(
            {
                "rollout/carried": totals[0],
                "rollout/continued": totals[1],
                "rollout/continued_kept": totals[7],
                "rollout/dropped_stale": totals[2],
                "rollout/dropped_stale_groups": totals[3],
                "rollout/carried_cut": totals[4],
                "rollout/version_span_mean": totals[5] / max(1.0, totals[6]),
                "rollout/version_span_max": float(span_max),
            }
        )
        metrics.update(engine_metrics(engine))
        return self._batch(kept, metrics, step)

    def _batch(self, kept, metrics: dict, step: int) -> tuple[Optional[RolloutBatch], dict]:
        """The kept groups as one RolloutBatch (None if none), their first completions logged."""
        G = self.cfg.rollout.n
        self._log_rollouts(kept, step)
        if not kept.rows:
            return None, metrics
        masks = [c.loss_mask for c in kept.completions] if self.env is not None else None
        batch = RolloutBatch.build(
            kept.rows,
            kept.prompt_ids,
            kept.completions,
            G,
            kept.rewards_N,
            kept.scores_N,
            self.tokenizer.pad_token_id,
            self.device,
            loss_masks=masks,
        )
        return batch, metrics

    def generate(
        self, engine, rows: list[dict], params: SamplingParams, episodes: Optional[MeanAccumulator] = None
    ) -> tuple[list[list[int]], list[Completion]]:
        """(B prompt ids, N = B*G completions, row-major): one generate call of the encoded prompts, or with an
        environment the rows' episodes (their metrics summed into `episodes`)."""
        G = self.cfg.rollout.n
        if self.env is None:
            prompt_ids = [self.encode(r) for r in rows]
            return prompt_ids, engine.generate([p for p in prompt_ids for _ in range(G)], params)
        eps = self.env.runner(engine, self.tokenizer).run(rows, G, params)
        if episodes is not None:
            for name, mean in episode_metrics(eps).items():
                episodes.add(name, mean * len(eps), len(eps))
        return group_prompts([e.as_completion() for e in eps], [e.prompt_ids for e in eps], G)

    def score(self, rows: list[dict], completions: list, model_phase=None):
        """(reward, score, logged parts) per completion (G per row, in order): the rule reward on the host and/or
        the reward model's score in the REWARD stage, weighted, + DAPO's soft overlong penalty
        (loop/reward_setup.py)."""
        return self.rewards.score(
            rows, completions, self.cfg.rollout.n, self.tokenizer, self.stop_set, model_phase=model_phase
        )

    def sampling_params(self, step: int, round_idx: int) -> SamplingParams:
        """The engine's sampling settings, with a new seed per step, rank and sampling round (97 and 7919 are
        coprime: no two collide)."""
        r = self.cfg.rollout
        seed = r.seed + 1_000_003 * step + 7919 * D.rank() + 97 * round_idx
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
            min_new_tokens=r.min_new_tokens,
        )

    def _log_rollouts(self, kept, step: int) -> None:
        """The first `trainer.log_rollouts` kept completions of the step, as text (rank 0)."""
        n_log = self.cfg.trainer.log_rollouts
        if not (n_log and D.is_main() and kept.rows):
            return
        n = min(n_log, len(kept.completions))
        texts = self.tokenizer.batch_decode(
            response_bodies(kept.completions[:n], self.stop_set), skip_special_tokens=True
        )
        log_rollouts(
            os.path.join(self.out_dir, "rollouts.jsonl"),
            step + 1,
            kept.rows,
            texts,
            kept.completions[:n],
            kept.rewards_N[:n].tolist(),
            kept.scores_N[:n].tolist(),
            self.cfg.rollout.n,
        )


class CallTally:
    """An engine seen through its generate calls: each call's account (`last_generated_tokens`, `last_tail_s`;
    rollout/base.py) added up over the calls made through it, in attributes of the same names, so that
    engine_metrics reads a step of several calls (dynamic sampling's rounds, an episode's turns) whole. A sum
    stays None while no call measured it."""

    def __init__(self, engine):
        self.engine = engine
        self.last_generated_tokens: Optional[int] = None
        self.last_tail_s: Optional[float] = None

    def generate(self, *args, **kwargs):
        out = self.engine.generate(*args, **kwargs)
        self.last_generated_tokens = _plus(
            self.last_generated_tokens, getattr(self.engine, "last_generated_tokens", None)
        )
        self.last_tail_s = _plus(self.last_tail_s, getattr(self.engine, "last_tail_s", None))
        return out


def _plus(total, x):
    return total if x is None else x if total is None else total + x


def engine_metrics(engine) -> dict[str, float]:
    """The engine's account of its generate calls of the step (one call, or a CallTally of several): tokens sampled
    (summed over ranks) and the slowest rank's seconds with fewer than half of a call's rows still decoding (a
    time: resumed runs need not repeat it). An engine that does not measure the tail reports -1."""
    tail, tokens = getattr(engine, "last_tail_s", None), getattr(engine, "last_generated_tokens", None)
    flag_tail = torch.tensor([0.0 if tail is None else 1.0, tail or 0.0], dtype=torch.float64)
    measured, tail_max = D.all_reduce_max(flag_tail).tolist()
    total = D.all_reduce_sum(torch.tensor([tokens or 0], dtype=torch.float64)).item()
    return {"time/rollout_tail": tail_max if measured else -1.0, "rollout/tokens_generated": total}


def reduce_episode_metrics(acc: MeanAccumulator) -> dict[str, float]:
    """The episode/* means over every rank, robust to environments whose metrics() report different keys on
    different ranks or sampling rounds (a tool error only one rank saw): the union of the names is gathered
    first, and a name counted over fewer than all of this rank's episodes gets 0 for the rest (an absent count
    is 0), so every rank reduces the same names and each mean is per episode. One small object gather a step."""
    names = sorted({n for ranks in D.all_gather_object(sorted(acc.sums)) for n in ranks})
    episodes = sum(acc.counts.get("episode/turns", [0]))  # every episode adds to every built-in name
    for name in names:
        missing = episodes - sum(acc.counts.get(name, []))
        if missing > 0:
            acc.add(name, 0.0, missing)
    out = acc.reduce()
    # The step's episodes over every rank and round: the console turns rates into counts with it.
    out["episode/count"] = float(D.all_reduce_sum(torch.tensor([float(episodes)], dtype=torch.float64)).item())
    return out


def group_prompts(
    completions: list[EpisodeCompletion], prompts: list[list[int]], G: int
) -> tuple[list[list[int]], list[EpisodeCompletion]]:
    """One prompt per group, as the batch lays them out: the longest prefix the G episodes' opening prompts
    share. An environment whose reset differs between episodes of a row (a shuffled tool list) keeps the
    rest of each prompt, moved into its completion under loss mask 0 and log-prob 0.0 (never trained)."""
    out_prompts, out = [], []
    for b in range(len(prompts) // G):
        group = prompts[b * G : (b + 1) * G]
        n = min(len(p) for p in group)
        n = next((i for i in range(n) if len({p[i] for p in group}) > 1), n)
        if n == 0:
            raise ValueError(
                f"the {G} episodes of row {b} open with different first tokens; an environment's "
                "reset(row) must open every episode of a row with the same chat template prefix"
            )
        out_prompts.append(group[0][:n])
        for p, c in zip(group, completions[b * G : (b + 1) * G]):
            extra = p[n:]
            out.append(
                EpisodeCompletion(
                    extra + c.token_ids,
                    [0.0] * len(extra) + c.logprobs,
                    c.finish_reason,
                    loss_mask=[0] * len(extra) + c.loss_mask,
                    episode=c.episode,
                )
            )
    return out_prompts, out
