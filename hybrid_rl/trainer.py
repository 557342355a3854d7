"""The GRPO loop, one `Trainer.step()` at a time:

    ROLLOUT  engine.generate(B/W prompts x G samples) on this rank
    REWARD   rule reward on CPU
    SCORE    old-policy logprobs (+ reference logprobs)
    ADVANTAGE  over the whole global batch
    TRAIN    epochs x mini-batches x micro-batches; optimizer step

Works under `torchrun` (one process per device) and in a plain process.
Legend: B prompts per step (global), G samples per prompt, N sequences, T tokens.
"""
from __future__ import annotations

import copy
import os
import time
from typing import Optional

import torch

from hybrid_rl import distributed as D
from hybrid_rl.algorithms.advantages import compute_advantages
from hybrid_rl.algorithms.aggregation import masked_mean
from hybrid_rl.algorithms.kl import kl_estimate
from hybrid_rl.config import Config, save_config
from hybrid_rl.data.prompts import PromptLoader, load_rows
from hybrid_rl.hybrid.phases import PhaseManager
from hybrid_rl.metrics import MeanAccumulator, append_jsonl, format_line, plot_curve
from hybrid_rl.models.fsdp import shard_model
from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
from hybrid_rl.models.logprobs import build_sequences
from hybrid_rl.rewards.base import compute_rewards, get_reward
from hybrid_rl.rollout.base import Completion, SamplingParams, engine_class
from hybrid_rl.update import RolloutBatch, policy_update, score_logprobs


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = D.init(cfg.trainer.device, cfg.trainer.dist_timeout_s)
        # Everything a user can get wrong is checked before a model is built.
        cfg.validate_runtime(D.world_size())
        torch.manual_seed(cfg.trainer.seed)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.reward_name, self.reward = cfg.reward.name, get_reward(cfg.reward.name)
        rows = load_rows(cfg.data.task, cfg.data.path, cfg.data.prompt_key, cfg.data.num_prompts, cfg.data.seed)
        self._probe_reward(rows[:2])
        self.loader = PromptLoader(rows, cfg.data.batch_size, D.rank(), D.world_size(), cfg.data.seed)

        mixed = self.device.type == "cuda" and cfg.model.dtype in ("auto", "bfloat16")
        policy = load_causal_lm(cfg.model.path, torch.float32, cfg.model.attn_implementation)
        if cfg.model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        ref = None
        if cfg.algorithm.kl_coef > 0:
            ref = copy.deepcopy(policy).requires_grad_(False).eval()
        self.policy = shard_model(policy, self.device, mixed)
        self.ref = shard_model(ref, self.device, mixed) if ref is not None else None

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        warm = o.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        engine_cls = engine_class(cfg.rollout.engine)
        self.engine = engine_cls(self.policy, pad_id=self.tokenizer.pad_token_id, eos_id=self.tokenizer.eos_token_id,
                                 weights_dtype=torch.bfloat16 if mixed else None)
        self.phases = PhaseManager(self.policy, self.optimizer, self.engine, self.device, ref=self.ref,
                                   offload_optimizer=cfg.offload.optimizer, offload_ref=cfg.offload.ref,
                                   offload_params=cfg.offload.params)
        self.step_idx = 0
        self.history: list[dict] = []
        self.out_dir = cfg.trainer.out_dir
        if D.is_main():
            os.makedirs(self.out_dir, exist_ok=True)
            save_config(cfg, os.path.join(self.out_dir, "config.yaml"))
            open(self.metrics_path, "w").close()
        D.barrier()

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.out_dir, "metrics.jsonl")

    def _probe_reward(self, rows: list[dict]) -> None:
        """Call the reward once on placeholder completions, so a broken function fails before training."""
        meta = [{**r, "finish_reason": "length", "response_tokens": 0} for r in rows]
        compute_rewards(self.reward_name, self.reward, [r["prompt"] for r in rows], ["" for _ in rows], meta)

    def _prompt_text(self, prompt: str) -> str:
        if not self.cfg.data.chat_template:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    # -- one step -------------------------------------------------------------
    def step(self) -> dict:
        cfg, G = self.cfg, self.cfg.rollout.n
        t_step = time.perf_counter()
        rows = self.loader.next_batch()
        prompt_ids = [self.tokenizer(self._prompt_text(r["prompt"]), add_special_tokens=False).input_ids for r in rows]
        expanded = [p for p in prompt_ids for _ in range(G)]
        r = cfg.rollout
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                stop_token_ids=tuple(r.stop_token_ids),
                                seed=r.seed + 1_000_003 * self.step_idx + 7919 * D.rank())
        timings: dict[str, float] = {}

        with self.phases.rollout() as engine:
            t0 = time.perf_counter()
            completions = engine.generate(expanded, params)
            timings["time/rollout"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        rewards_n = self._rewards(rows, completions)
        timings["time/reward"] = time.perf_counter() - t0

        ids, attn, mask, P = build_sequences(expanded, [c.token_ids for c in completions], self.tokenizer.pad_token_id, self.device)
        mask = mask.float()
        engine_logp = torch.zeros_like(mask)
        for i, c in enumerate(completions):
            engine_logp[i, :len(c.logprobs)] = torch.tensor(c.logprobs)

        with self.phases.score() as ref:
            t0 = time.perf_counter()
            mb = cfg.trainer.micro_batch_size
            old_logp, entropy = score_logprobs(self.policy, ids, attn, P, r.temperature, mb)
            ref_logp = score_logprobs(ref, ids, attn, P, r.temperature, mb)[0] if ref is not None else None
            timings["time/score"] = time.perf_counter() - t0

        adv = self._advantages(rewards_n)
        batch = RolloutBatch(ids, attn, mask, P, old_logp, adv.to(self.device), ref_logp)
        with self.phases.train() as optimizer:
            t0 = time.perf_counter()
            train_metrics = policy_update(self.policy, optimizer, self.scheduler, batch, cfg.algorithm, r.temperature,
                                          cfg.trainer.micro_batch_size, cfg.optim.grad_clip, r.max_new_tokens,
                                          seed=cfg.trainer.seed + self.step_idx)
            timings["time/train"] = time.perf_counter() - t0

        metrics = self._step_metrics(rewards_n, completions, mask, old_logp, engine_logp, entropy, ref_logp)
        metrics.update(train_metrics)
        switch = self.phases.pop_stats()
        for stage, sec in switch.seconds.items():
            timings[f"switch/{stage}_s"] = sec
        timings["time/switch"] = sum(switch.seconds.values())
        timings["time/step"] = time.perf_counter() - t_step
        # Report the slowest rank's time for each stage: that is what the step waits for.
        names = sorted(timings)
        slowest = D.all_reduce_max(torch.tensor([timings[k] for k in names], dtype=torch.float64))
        metrics.update({k: slowest[i].item() for i, k in enumerate(names)})
        self.step_idx += 1
        metrics["step"] = self.step_idx
        return metrics

    def _rewards(self, rows: list[dict], completions: list[Completion]) -> torch.Tensor:
        G = self.cfg.rollout.n
        stops = {self.tokenizer.eos_token_id, *self.cfg.rollout.stop_token_ids}
        body = [c.token_ids[:-1] if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in stops else c.token_ids
                for c in completions]
        texts = self.tokenizer.batch_decode(body, skip_special_tokens=True)
        prompts = [rows[i // G]["prompt"] for i in range(len(completions))]
        meta = [{**rows[i // G], "finish_reason": c.finish_reason, "response_tokens": len(b)}
                for i, (c, b) in enumerate(zip(completions, body))]
        return torch.tensor(compute_rewards(self.reward_name, self.reward, prompts, texts, meta), dtype=torch.float32)

    def _advantages(self, rewards_n: torch.Tensor) -> torch.Tensor:
        """Advantages over the global batch (estimators may normalise over it), then this rank's slice."""
        G, n = self.cfg.rollout.n, rewards_n.shape[0]
        rewards_all = D.all_gather_cat(rewards_n)
        group_ids = torch.arange(rewards_all.shape[0]) // G
        adv_all = compute_advantages(self.cfg.algorithm.advantage, rewards_all, group_ids, eps=self.cfg.algorithm.adv_eps)
        return adv_all[D.rank() * n:(D.rank() + 1) * n]

    def _step_metrics(self, rewards_n, completions, mask, old_logp, engine_logp, entropy, ref_logp) -> dict:
        acc = MeanAccumulator()
        thr = self.reward.success_threshold
        acc.add("reward/mean", rewards_n.sum().item(), len(rewards_n))
        acc.add("reward/sq", (rewards_n ** 2).sum().item(), len(rewards_n))
        acc.add("reward/accuracy", (rewards_n >= thr - 1e-9).float().sum().item(), len(rewards_n))
        acc.add("response/length", float(sum(len(c.token_ids) for c in completions)), len(completions))
        acc.add("response/truncated", float(sum(c.finish_reason == "length" for c in completions)), len(completions))
        n_tok = mask.sum().item()
        acc.add("actor/entropy", masked_mean(entropy, mask).item() * n_tok, n_tok)
        acc.add("rollout/logp_mismatch", masked_mean((old_logp - engine_logp).abs(), mask).item() * n_tok, n_tok)
        if ref_logp is not None:
            acc.add("actor/kl_ref", masked_mean(kl_estimate(old_logp, ref_logp, self.cfg.algorithm.kl_estimator), mask).item() * n_tok, n_tok)
        m = acc.reduce()
        m["reward/std"] = max(0.0, m.pop("reward/sq") - m["reward/mean"] ** 2) ** 0.5
        return m

    # -- the loop -------------------------------------------------------------
    def fit(self, steps: Optional[int] = None) -> list[dict]:
        """Run `steps` more steps (default: up to trainer.total_steps); returns the metrics history."""
        from tqdm.auto import tqdm

        total = steps if steps is not None else self.cfg.trainer.total_steps - self.step_idx
        show = D.is_main() and self.cfg.trainer.progress_bar
        bar = tqdm(total=total, disable=not show, desc="grpo", dynamic_ncols=True)
        try:
            for _ in range(total):
                m = self.step()
                self.history.append(m)
                if D.is_main():
                    append_jsonl(self.metrics_path, m)
                    bar.set_postfix(reward=f"{m['reward/mean']:.3f}")
                    if self.cfg.trainer.log_every and self.step_idx % self.cfg.trainer.log_every == 0:
                        (bar.write if show else print)(format_line(m))
                bar.update()
        finally:
            bar.close()
            if D.is_main() and self.history:
                plot_curve(self.history, os.path.join(self.out_dir, "reward_curve.png"))
        return self.history
