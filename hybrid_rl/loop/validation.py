"""Validation: pass@1 with greedy decoding on the held-out prompts, through the rollout engine,
and with `trainer.val_n=k` also mean@k / pass@k over k sampled completions per prompt.

It runs inside a ROLLOUT phase (`phases.rollout()`: weights synced, KV cache
resumed) and goes back to TRAIN the legal way (`with phases.train(): pass`), so what
is resident stays decided by switch/phases.py alone. Its switch seconds are drained
here and reported as `val/switch_s`, so no training step is billed for them.

The validation set is walked in batches of `data.val_batch_size` prompts (over all
ranks); each rank generates an interleaved slice of every batch, and every rank makes
the same number of generate calls (an engine may be collective across ranks). Means
are reduced over ranks. Metrics (`val/` prefix):
  pass@1          fraction of prompts whose greedy completion is correct (reward >= the
                  reward's success threshold)
  reward_mean     mean greedy reward; response_length, truncated (cut at max_new_tokens)
  mean@k, pass@k  with val_n=k: mean correctness of k samples; any of the k correct
  reward_mean@k   mean reward of the k samples
  prompts, time_s, switch_s
With an environment (env.*) every completion is an episode (envs/episodes.py) and its reward the
episode's return (+ the rule reward where weighted); `response_length` then counts observation tokens too.
Rank 0 appends its first `trainer.val_sample_rows` prompts with their completions and
rewards to out_dir/val_samples.jsonl, one JSON object per prompt, tagged with the step.

Legend: B prompts in this rank's slice of a validation batch, k samples per prompt.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Sequence

import torch

from hybrid_rl.config.schema import Config
from hybrid_rl.loop.reward_setup import RewardSetup
from hybrid_rl.observability.metrics import MeanAccumulator
from hybrid_rl.runtime import distributed as D
from hybrid_rl.types import Completion, SamplingParams


def check_val_set(rows: Sequence[dict], batch_size: int, source: str) -> None:
    """A validation set must fill at least one of its batches (raised before the first step)."""
    if len(rows) < batch_size:
        raise ValueError(
            f"the validation set ({source}) has {len(rows)} prompts, fewer than its batch of "
            f"{batch_size} (config key 'data.val_batch_size', null = data.batch_size); use a larger "
            "validation set (data.val_size, data.val_split) or a smaller data.val_batch_size"
        )


class Validator:
    """Runs the validation set through the engine between steps; built from what it reads, not the Trainer.

    rows: the validation prompts (checked with `check_val_set`); encode: row -> prompt ids (tokenized once);
    rewards: the run's `RewardSetup` (its rule reward scores; `rule_rewards` as in training); phases: the
    phase switch whose ROLLOUT it enters (a split rollout rank's: split.validation.ResidentEngine);
    stop_token_ids: what every generate call stops on, and stop_ids the tokens cut from a completion's end before
    it is scored (the trainer's own sets)."""

    def __init__(
        self,
        cfg: Config,
        rows: list[dict],
        encode: Callable[[dict], list[int]],
        rewards: RewardSetup,
        tokenizer,
        phases,
        stop_token_ids: tuple[int, ...],
        stop_ids: set[int],
        out_dir: str,
    ):
        self.cfg, self.rows, self.encode, self.rewards = cfg, rows, encode, rewards
        self.tokenizer, self.phases, self.out_dir = tokenizer, phases, out_dir
        self.stop_token_ids, self.stop_ids = stop_token_ids, stop_ids

    def run(self, step: int) -> dict[str, float]:
        """Run the validation set through the engine now (between steps, in TRAIN); returns the `val/*` metrics.
        After an exception the phase switch is back in TRAIN (`PhaseManager.recover`), as after a failed step."""
        metrics, samples = self.measure(step)
        self.write_samples(samples)
        return metrics

    def measure(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """`run` without writing: the metrics (reduced over ranks) and this rank's sample records (the split
        placement's rollout ranks send them to learner rank 0, which writes them)."""
        with self.phases.recovering():
            return self._run(step)

    def write_samples(self, samples: list[dict]) -> None:
        """Append sample records to out_dir/val_samples.jsonl (global rank 0 only)."""
        if D.is_main() and samples:
            with open(os.path.join(self.out_dir, "val_samples.jsonl"), "a") as f:
                for record in samples:
                    f.write(json.dumps(record) + "\n")

    def _score(self, rows: list[dict], completions: list[Completion], k: int) -> tuple[list[str], torch.Tensor]:
        """(texts, rewards_N) of N = len(rows) * k completions, row-major: the rule reward, as training sees it;
        with an environment, the episode's return (its `env` part) plus the rule reward where it is weighted."""
        w = self.rewards.weights
        texts, rewards = (
            self.rewards.rule_rewards(rows, completions, k, self.tokenizer, self.stop_ids)
            if "rule" in w or self.rewards.env is None
            else ([c.text for c in completions], [0.0] * len(completions))
        )
        if self.rewards.env is not None:
            rewards = [
                w.get("rule", 0.0) * r + w.get("env", 0.0) * c.episode.reward for r, c in zip(rewards, completions)
            ]
        return texts, torch.tensor(rewards, dtype=torch.float64)

    def _generate(self, engine, rows: list[dict], ids: list[list[int]], params: SamplingParams, k: int) -> list:
        """k completions per row: one generate call, or with an environment k episodes per row."""
        if self.rewards.env is None:
            return engine.generate([p for p in ids for _ in range(k)], params)
        return [e.as_completion() for e in self.rewards.env.runner(engine, self.tokenizer).run(rows, k, params)]

    def _run(self, step: int) -> tuple[dict[str, float], list[dict]]:
        cfg, rows = self.cfg, self.rows
        r, k = cfg.rollout, cfg.trainer.val_n
        batch = cfg.data.val_batch_size or cfg.data.batch_size
        threshold = self.rewards.rule.success_threshold - 1e-9
        stop = self.stop_token_ids
        acc, samples = MeanAccumulator(), []
        t0 = time.perf_counter()
        with self.phases.rollout() as engine:
            for start in range(0, len(rows), batch):
                mine = rows[start : start + batch][D.rank() :: D.world_size()]
                ids = [self.encode(row) for row in mine]
                greedy = self._generate(
                    engine,
                    mine,
                    ids,
                    SamplingParams(max_new_tokens=r.max_new_tokens, stop_token_ids=stop, greedy=True, seed=r.seed),
                    1,
                )
                texts, rewards_B = self._score(mine, greedy, 1)
                n = len(mine)
                acc.add("val/pass@1", (rewards_B >= threshold).sum(), n)
                acc.add("val/reward_mean", rewards_B.sum(), n)
                acc.add("val/response_length", sum(c.generated_tokens for c in greedy), n)
                acc.add("val/truncated", sum(c.truncated for c in greedy), n)
                s_texts, s_rewards = [], torch.zeros(0, dtype=torch.float64)
                if k:
                    seed = r.seed + 1_000_003 * step + 7919 * D.rank() + start
                    sampled = self._generate(
                        engine,
                        mine,
                        ids,
                        SamplingParams(
                            max_new_tokens=r.max_new_tokens,
                            temperature=r.temperature,
                            top_p=r.top_p,
                            top_k=r.top_k,
                            stop_token_ids=stop,
                            seed=seed,
                        ),
                        k,
                    )
                    s_texts, s_rewards = self._score(mine, sampled, k)
                    right_Bk = (s_rewards >= threshold).view(n, k)
                    acc.add(f"val/mean@{k}", right_Bk.sum(), n * k)
                    acc.add(f"val/pass@{k}", right_Bk.any(dim=1).sum(), n)
                    acc.add(f"val/reward_mean@{k}", s_rewards.sum(), n * k)
                for i in range(min(n, cfg.trainer.val_sample_rows - len(samples))):
                    samples.append(
                        _sample_record(
                            step,
                            mine[i],
                            texts[i],
                            greedy[i],
                            rewards_B[i].item(),
                            s_texts[i * k : (i + 1) * k],
                            s_rewards[i * k : (i + 1) * k].tolist(),
                        )
                    )
        with self.phases.train():
            pass  # back round the cycle: TRAIN -> ROLLOUT -> TRAIN
        switch = self.phases.pop_stats()
        metrics = acc.reduce()
        metrics.update(
            {
                "val/prompts": float(len(rows)),
                "val/time_s": time.perf_counter() - t0,
                "val/switch_s": sum(switch.seconds.values()),
            }
        )
        return metrics, samples


def _sample_record(
    step: int, row: dict, text: str, c: Completion, reward: float, sampled: list[str], sampled_rewards: list[float]
) -> dict:
    record = {
        "step": step,
        "prompt": row["prompt"],
        "completion": text,
        "reward": reward,
        "finish_reason": c.finish_reason,
    }
    for key in ("ground_truth", "answer"):
        if key in row:
            record[key] = str(row[key])
    if sampled:
        record["samples"] = [{"completion": t, "reward": x} for t, x in zip(sampled, sampled_rewards)]
    return record
