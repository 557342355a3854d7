"""The GRPO loop, one `Trainer.step()` at a time:

    ROLLOUT  engine.generate(B/W prompts x G samples) on this rank, rule rewards on CPU
             (+ DAPO soft overlong penalty); with dynamic sampling, groups whose
             scores are all equal are dropped and more prompts generated (sampling.py)
    SCORE    old-policy logprobs (+ reference logprobs when a KL term needs them)
    SHAPE    overlong filter and rollout correction (loss mask, TIS weights);
             KL as a reward penalty (kl_placement=reward), KL controller update
    ADVANTAGE  over the whole global batch
    TRAIN    epochs x mini-batches x micro-batches; optimizer step (update.py:
             policy loss, KL in the loss, entropy bonus)

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
from hybrid_rl.algorithms.correction import rollout_correction
from hybrid_rl.algorithms.dapo import overlong_penalty, truncation_mask
from hybrid_rl.algorithms.kl import AdaptiveKLController, FixedKLController, kl_estimate, kl_penalty_rewards
from hybrid_rl.config import Config, save_config
from hybrid_rl.data.prompts import PromptLoader, load_rows
from hybrid_rl.hybrid.advice import decide_offload
from hybrid_rl.hybrid.phases import PhaseManager
from hybrid_rl.metrics import MeanAccumulator, append_jsonl, bottleneck, format_line, plot_curve, split_summary
from hybrid_rl.models.fsdp import shard_model
from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
from hybrid_rl.models.logprobs import build_sequences
from hybrid_rl.models.saving import save_pretrained
from hybrid_rl.rewards.base import compute_rewards, get_reward
from hybrid_rl.rollout.base import Completion, SamplingParams, engine_class
from hybrid_rl.sampling import SampledGroups, sample_groups
from hybrid_rl.update import RolloutBatch, is_on_policy, policy_update, score_logprobs


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = D.init(cfg.trainer.device, cfg.trainer.dist_timeout_s)
        # Everything a user can get wrong is checked before a model is built.
        cfg.validate_runtime(D.world_size())
        a = cfg.algorithm
        buffer = a.overlong_buffer_len
        if buffer is not None and buffer > cfg.rollout.max_new_tokens:
            raise ValueError(f"config key 'algorithm.overlong_buffer_len': {buffer} is longer than "
                             f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}; use at most that (or null)")
        # DAPO's buffer is a fifth of the maximum length (4096 of 20480); rounded down.
        self.overlong_buffer = buffer if buffer is not None else cfg.rollout.max_new_tokens // 5
        self.kl_ctl = (AdaptiveKLController(a.kl_coef, a.target_kl, a.kl_horizon) if a.kl_controller == "adaptive"
                       else FixedKLController(a.kl_coef))
        torch.manual_seed(cfg.trainer.seed)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.reward_name, self.reward = cfg.reward.name, get_reward(cfg.reward.name)
        rows = load_rows(cfg.data.task, cfg.data.path, cfg.data.prompt_key, cfg.data.num_prompts, cfg.data.seed)
        self._probe_reward(rows[:2])
        self.loader = PromptLoader(rows, cfg.data.batch_size, D.rank(), D.world_size(), cfg.data.seed)

        mixed = self.device.type == "cuda" and cfg.model.dtype in ("auto", "bfloat16")
        longest_prompt = max(len(self.tokenizer(self._prompt_text(r["prompt"])).input_ids) for r in rows[:256])
        self.offload = decide_offload(cfg.offload, cfg.model.path, self.device, D.world_size(), mixed,
                                      sequences=cfg.data.batch_size * cfg.rollout.n,
                                      context=longest_prompt + cfg.rollout.max_new_tokens,
                                      has_ref=cfg.algorithm.needs_ref_model)
        policy = load_causal_lm(cfg.model.path, torch.float32, cfg.model.attn_implementation)
        if cfg.model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        ref = None
        if cfg.algorithm.needs_ref_model:
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
                                   offload_optimizer=self.offload.optimizer, offload_ref=self.offload.ref,
                                   offload_params=self.offload.params)
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
        cfg, algo = self.cfg, self.cfg.algorithm
        t_step = time.perf_counter()
        timings = {k: 0.0 for k in ("time/rollout", "time/reward", "time/score", "time/train")}

        # Generation and rule rewards share one ROLLOUT phase: dynamic sampling may need
        # several rounds, and the engine's memory should be switched in once per step.
        with self.phases.rollout() as engine:
            sampled = sample_groups(self.loader.next_batch, lambda rows, k: self._generate(engine, rows, k, timings),
                                    lambda rows, comps: self._score_completions(rows, comps, timings),
                                    cfg.rollout.n, algo.dynamic_sampling, algo.max_sampling_rounds)

        metrics = self._reward_metrics(sampled)
        metrics.update(sampled.metrics)
        if sampled.rows:
            metrics.update(self._learn(sampled, timings))
        else:
            # Every rank agreed that no group is informative: nothing to train on this step.
            with self.phases.train():
                pass
        switch = self.phases.pop_stats()
        for stage, sec in switch.seconds.items():
            timings[f"switch/{stage}_s"] = sec
        timings["time/switch"] = sum(switch.seconds.values())
        timings["time/step"] = time.perf_counter() - t_step
        # Report the slowest rank's time for each stage: that is what the step waits for.
        names = sorted(timings)
        slowest = D.all_reduce_max(torch.tensor([timings[k] for k in names], dtype=torch.float64))
        metrics.update({k: slowest[i].item() for i, k in enumerate(names)})
        metrics.update(self.phases.ledger.step_metrics(self.phases.step))
        self.step_idx += 1
        metrics["step"] = self.step_idx
        metrics["bottleneck"] = bottleneck(metrics)
        return metrics

    def _encode(self, rows: list[dict]) -> list[list[int]]:
        """Prompt token ids, each repeated G times (row-major, as the completions are)."""
        G = self.cfg.rollout.n
        ids = [self.tokenizer(self._prompt_text(r["prompt"]), add_special_tokens=False).input_ids for r in rows]
        return [p for p in ids for _ in range(G)]

    def _generate(self, engine, rows: list[dict], round_idx: int, timings: dict) -> list[Completion]:
        r = self.cfg.rollout
        # A new seed per step, rank and sampling round (97 and 7919 are coprime: no two collide).
        seed = r.seed + 1_000_003 * self.step_idx + 7919 * D.rank() + 97 * round_idx
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, stop_token_ids=tuple(r.stop_token_ids), seed=seed)
        t0 = time.perf_counter()
        completions = engine.generate(self._encode(rows), params)
        timings["time/rollout"] += time.perf_counter() - t0
        return completions

    def _score_completions(self, rows: list[dict], completions: list[Completion], timings: dict):
        """(task reward, score): the score adds the DAPO soft overlong penalty when it is on."""
        t0 = time.perf_counter()
        rewards_n = self._rewards(rows, completions)
        scores_n = rewards_n
        algo = self.cfg.algorithm
        if algo.overlong_penalty_factor > 0:
            lengths = torch.tensor([len(c.token_ids) for c in completions])
            scores_n = rewards_n + overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, self.overlong_buffer,
                                                    algo.overlong_penalty_factor)
        timings["time/reward"] += time.perf_counter() - t0
        return rewards_n, scores_n

    def _learn(self, sampled: SampledGroups, timings: dict) -> dict:
        """SCORE -> (KL, correction, masks) -> ADVANTAGE -> TRAIN on the sampled groups."""
        cfg, algo, temp = self.cfg, self.cfg.algorithm, self.cfg.rollout.temperature
        completions = sampled.completions
        ids, attn, resp_mask, P = build_sequences(self._encode(sampled.rows), [c.token_ids for c in completions],
                                                  self.tokenizer.pad_token_id, self.device)
        resp_mask = resp_mask.float()
        engine_logp = torch.zeros_like(resp_mask)
        for i, c in enumerate(completions):
            engine_logp[i, :len(c.logprobs)] = torch.tensor(c.logprobs)

        # On-policy with nothing to decide from old log-probs before the update: the update's
        # own forward serves as the old policy, and scoring runs only the reference.
        skip_old = (is_on_policy(algo, len(completions) * D.world_size()) and algo.rollout_correction == "none"
                    and algo.kl_placement != "reward")
        with self.phases.score() as ref:
            t0 = time.perf_counter()
            mb = cfg.trainer.micro_batch_size
            old_logp = entropy = None
            if not skip_old:
                old_logp, entropy = score_logprobs(self.policy, ids, attn, P, temp, mb)
            ref_logp = score_logprobs(ref, ids, attn, P, temp, mb)[0] if ref is not None else None
            timings["time/score"] = time.perf_counter() - t0

        acc, m = MeanAccumulator(), {}
        n_tok = resp_mask.sum().item()
        if not skip_old:
            acc.add("rollout/logp_mismatch", masked_mean((old_logp - engine_logp).abs(), resp_mask).item() * n_tok, n_tok)
            acc.add("actor/entropy", masked_mean(entropy, resp_mask).item() * n_tok, n_tok)
        loss_mask, weight = self._loss_mask(completions, resp_mask, old_logp, engine_logp, acc, m)
        coef = self.kl_ctl.value  # this step's coefficient; _kl_shaping then updates the controller
        scores_n = sampled.scores_N
        if not skip_old:
            scores_n = self._kl_shaping(scores_n, old_logp, ref_logp, resp_mask, acc, m)
        if algo.overlong_penalty_factor > 0:
            acc.add("reward/overlong_penalty", (sampled.scores_N - sampled.rewards_N).sum().item(), len(scores_n))

        adv = self._advantages(scores_n)
        batch = RolloutBatch(ids, attn, loss_mask, P, old_logp, adv.to(self.device), ref_logp, weight,
                             engine_logp_NT=engine_logp if skip_old else None)
        with self.phases.train() as optimizer:
            t0 = time.perf_counter()
            m.update(policy_update(self.policy, optimizer, self.scheduler, batch, algo, temp,
                                   cfg.trainer.micro_batch_size, cfg.optim.grad_clip, cfg.rollout.max_new_tokens,
                                   seed=cfg.trainer.seed + self.step_idx, kl_coef=coef))
            timings["time/train"] = time.perf_counter() - t0
        if skip_old:
            # The update measured these on the very policy that generated the batch.
            m["actor/entropy"] = m["actor/entropy_train"]
            if "actor/kl_loss" in m:
                m["actor/kl_ref"], m["actor/kl_coef"] = m["actor/kl_loss"], coef
                self.kl_ctl.update(m["actor/kl_loss"], len(scores_n) * D.world_size())
        acc.add("reward/trained_mean", sampled.rewards_N.sum().item(), len(sampled.rewards_N))
        m.update(acc.reduce())
        return m

    def _loss_mask(self, completions, resp_mask, old_logp, engine_logp, acc, m):
        """(loss mask, TIS weight or None): overlong filter, then rollout correction (MIS may mask more)."""
        algo = self.cfg.algorithm
        loss_mask = resp_mask
        if algo.overlong_filter:
            truncated = torch.tensor([c.finish_reason == "length" for c in completions], device=self.device)
            loss_mask = truncation_mask(truncated, loss_mask)
            acc.add("response/overlong_filtered", truncated.float().sum().item(), len(completions))
        if old_logp is None:  # on-policy, no correction: nothing to compare yet
            acc.add("response/loss_tokens", loss_mask.sum().item(), len(completions))
            return loss_mask, None
        n_tok = loss_mask.sum().item()  # the correction's metrics are means over its input mask
        weight, loss_mask, corr = rollout_correction(old_logp, engine_logp, loss_mask, algo.rollout_correction,
                                                     algo.correction_cap, algo.correction_lower)
        for k, v in sorted(corr.items()):
            if k.endswith("_max"):
                m[f"rollout/{k}"] = D.all_reduce_max(v.detach().double().cpu().reshape(1)).item()
            else:
                acc.add(f"rollout/{k}", v.item() * n_tok, n_tok)
        acc.add("response/loss_tokens", loss_mask.sum().item(), len(completions))
        return loss_mask, (weight if algo.rollout_correction.startswith("tis") else None)

    def _kl_shaping(self, scores_n, old_logp, ref_logp, resp_mask, acc, m) -> torch.Tensor:
        """Measure KL(policy || ref), subtract it from the scores if it is placed in the reward, update the controller."""
        if ref_logp is None:
            return scores_n
        algo, coef = self.cfg.algorithm, self.kl_ctl.value
        kl_NT = kl_estimate(old_logp, ref_logp, algo.kl_estimator, mask_NT=resp_mask)
        kl_sum = D.all_reduce_sum(torch.tensor([kl_NT.sum().item(), resp_mask.sum().item()], dtype=torch.float64))
        kl_mean = (kl_sum[0] / kl_sum[1].clamp(min=1)).item()
        m["actor/kl_ref"], m["actor/kl_coef"] = kl_mean, coef
        if algo.kl_placement == "reward":
            shaped = kl_penalty_rewards(scores_n.to(self.device), kl_NT, resp_mask, coef).cpu()
            acc.add("reward/kl_penalty", (scores_n - shaped).sum().item(), len(scores_n))
            scores_n = shaped
        # Ziegler et al.: the controller sees the measured KL and the number of samples since its last update.
        self.kl_ctl.update(kl_mean, len(scores_n) * D.world_size())
        return scores_n

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

    def _advantages(self, scores_n: torch.Tensor) -> torch.Tensor:
        """Advantages over the global batch (estimators may normalise over it), then this rank's slice."""
        G, n = self.cfg.rollout.n, scores_n.shape[0]
        scores_all = D.all_gather_cat(scores_n)
        group_ids = torch.arange(scores_all.shape[0]) // G
        adv_all = compute_advantages(self.cfg.algorithm.advantage, scores_all, group_ids, eps=self.cfg.algorithm.adv_eps)
        return adv_all[D.rank() * n:(D.rank() + 1) * n]

    def _reward_metrics(self, sampled: SampledGroups) -> dict:
        """Over every completion generated this step (all sampling rounds): an unbiased view of the policy."""
        acc = MeanAccumulator()
        rewards_n, completions = sampled.all_rewards_N, sampled.all_completions
        thr = self.reward.success_threshold
        acc.add("reward/mean", rewards_n.sum().item(), len(rewards_n))
        acc.add("reward/sq", (rewards_n ** 2).sum().item(), len(rewards_n))
        acc.add("reward/accuracy", (rewards_n >= thr - 1e-9).float().sum().item(), len(rewards_n))
        acc.add("response/length", float(sum(len(c.token_ids) for c in completions)), len(completions))
        acc.add("response/truncated", float(sum(c.finish_reason == "length" for c in completions)), len(completions))
        m = acc.reduce()
        m["reward/std"] = max(0.0, m.pop("reward/sq") - m["reward/mean"] ** 2) ** 0.5
        return m

    def save_pretrained(self, path: str) -> str:
        """Save the current policy and tokenizer as a Hugging Face directory (call on every rank)."""
        if self.phases.inside is not None:
            raise RuntimeError(f"cannot save inside the {self.phases.inside.value} phase; save between steps")
        return save_pretrained(self.policy, self.tokenizer, path)

    def _write_memory_report(self) -> None:
        """The last step's memory ledger as a table and a timeline PNG, next to the metrics."""
        step = self.phases.step
        if not self.phases.ledger.step_snapshots(step):
            return
        with open(os.path.join(self.out_dir, "memory.txt"), "w") as f:
            f.write(f"{self.offload.message}\n\n{self.phases.ledger.table(step)}\n")
        self.phases.ledger.plot(step, os.path.join(self.out_dir, "memory_timeline.png"))

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
                self._write_memory_report()
                print(split_summary(self.history))
        return self.history
