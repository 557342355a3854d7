"""The GRPO loop, one `Trainer.step()` at a time, in the stages of DESIGN.md's loop:

    ROLLOUT    this rank's prompts (tokenized once) x G samples through the engine (loop/rollout_stage.py);
    REWARD     rule rewards on the host and/or the reward model in its own stage
               (phases.reward(), nested in ROLLOUT), weighted, + DAPO soft overlong penalty
               (RewardSetup.score, loop/reward_setup.py); with dynamic sampling, rounds repeat
               until enough informative groups (loop/dynamic_sampling.py)
    SCORE      old-policy log-probs (when `scores_old_policy` says so) + reference log-probs
    ADVANTAGE  loss mask (overlong filter, rollout correction), KL as a reward penalty,
               advantages of this rank's groups (loop/advantage_stage.py)
    TRAIN      epochs x mini-batches x micro-batches; optimizer step (loop/update.py, batch.py)
    metrics    one reduction per stage, the slowest rank's seconds, the memory ledger;
               the KL controller is updated here, once, from the KL this step measured

The run's mutable state is a `RunState` (loop/run_state.py); `fit` runs steps, validates every
`trainer.val_every` (validation.Validator: its own ROLLOUT -> TRAIN round of the phase cycle,
between steps), hands each step's metrics to the loggers (observability/loggers.py), writes checkpoints every
`trainer.save_every` steps (run_state.Checkpointer; resume is decided in `__init__`) and stops
cleanly on SIGTERM / SIGINT. Each collaborator is built from the parts it uses, not the Trainer.

Works under `torchrun` (one process per device) and in a plain process.
Legend: B prompts per step (global), G samples per prompt, N sequences, T tokens.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from typing import Optional

import torch

from hybrid_rl.algorithms.kl import AdaptiveKLController, FixedKLController
from hybrid_rl.batch import RolloutBatch
from hybrid_rl.checkpoint import sharded as ckpt
from hybrid_rl.config.load import load_config, save_config
from hybrid_rl.config.schema import Config
from hybrid_rl.data.chat import PromptEncoder, use_chat_template
from hybrid_rl.data.prepare import prepare_rows
from hybrid_rl.data.prompts import PromptLoader, load_datasets
from hybrid_rl.loop.advantage_stage import advantage_stage
from hybrid_rl.loop.critic_update import CriticSettings, critic_update, score_values
from hybrid_rl.loop.lr_schedule import lr_factor, optimizer_steps
from hybrid_rl.loop.partial import PartialRollouts
from hybrid_rl.loop.preflight import validate_runtime
from hybrid_rl.loop.reward_setup import RewardSetup
from hybrid_rl.loop.rollout_stage import RolloutStage
from hybrid_rl.loop.run_state import Checkpointer, RunState, find_resume
from hybrid_rl.loop.update import UpdateSettings, policy_update, score_logprobs, scores_old_policy
from hybrid_rl.loop.validation import Validator, check_val_set
from hybrid_rl.models.fsdp import load_sharded, prepare_policy, prepare_reference
from hybrid_rl.models.loading import load_tokenizer, model_eos_ids
from hybrid_rl.models.lora import adapters_disabled, policy_loading, trainable_parameters
from hybrid_rl.models.value import ValueModel, load_value_model
from hybrid_rl.observability.dashboard import draw_run, phase_memory
from hybrid_rl.observability.loggers import build_loggers, check_loggers, console_write, interactive
from hybrid_rl.observability.metrics import (
    StageTimer,
    bottleneck,
    run_history,
    split_summary,
    step_time_metrics,
)
from hybrid_rl.rewards.base import RewardFn
from hybrid_rl.rollout.base import engine_class
from hybrid_rl.runtime import distributed as D
from hybrid_rl.runtime.host_malloc import keep_freed_blocks
from hybrid_rl.runtime.stop import StopSignal, TrainingInterrupted
from hybrid_rl.split import roles as split_roles
from hybrid_rl.switch.advice import decide_offload, sglang_kv_room_warning
from hybrid_rl.switch.phases import PhaseManager


class Trainer:
    def __init__(self, cfg: Config, reward_fn: Optional[RewardFn] = None):
        """`reward_fn`: a reward function (prompts, completions, metadata) -> floats, instead of the
        registry's `reward.name` or an imported `reward.fn`; it gets the same checks (rewards/base.py).
        `cfg` is checked again as `load_config` checks it (types and values): a notebook may have changed
        fields after loading it (`cfg.rollout.n = 1`), which no check had seen."""
        self.cfg = load_config(base=cfg)
        resume_meta = self._build_runtime()  # device, the checks that need no model, the checkpoint to resume
        # The reward's parts (rule, model); the reward model's directory, tokenizer and score are checked here.
        self.rewards = RewardSetup.resolve(self.cfg, reward_fn)
        train_rows, val_rows = self._build_data()  # tokenizer, stop tokens, prompts; the reward probed
        if self.is_rollout:  # split placement: an engine over its own copy of the policy, no optimizer
            return self._build_rollout_rank(train_rows, val_rows)
        self._build_models(train_rows)  # offload plan, policy, reference, reward model
        self._build_optimizer()
        self._build_engine_and_phases(train_rows, val_rows)
        self._build_collaborators(val_rows, resume_meta)  # checkpointer, validator, out_dir, loggers
        if self.resume_from:
            self.checkpointer.restore(self.resume_from)
        D.barrier()

    def _build_runtime(self) -> Optional[dict]:
        """The device and process-wide settings; everything a user can get wrong is checked before a model is
        built, and the checkpoint to resume from is found and checked before anything is built or written."""
        cfg = self.cfg
        self.device = D.init(cfg.trainer.device, timeout_s=cfg.process_group_timeout_s)
        if self.device.type == "cpu" and cfg.trainer.keep_host_memory:
            keep_freed_blocks()
        validate_runtime(cfg, D.world_size())
        self.split = split_roles.setup(cfg, self.device)  # None when colocated; scopes D's collectives to the pool
        self.is_rollout = bool(self.split and self.split.is_rollout)
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            self._model_config = json.load(f)
        self.resume_from, resume_meta = (None, None) if self.is_rollout else find_resume(cfg, self._model_config)
        if cfg.rollout.engine == "sglang":
            from hybrid_rl.rollout.sglang.engine import check_available

            check_available()
        if cfg.rollout.engine == "vllm":  # importable, a model vLLM implements, tp_size dividing the ranks
            from hybrid_rl.rollout.vllm.engine import check_config

            check_config(cfg, self.device)
        if self.device.type == "cpu" and cfg.model.dtype == "bfloat16":
            warnings.warn(
                "model.dtype=bfloat16 is ignored on CPU: the policy trains in float32 there "
                "(bf16 mixed precision is a CUDA path)"
            )
        check_loggers(cfg.trainer.loggers)
        ckpt.seed_all(cfg.trainer.seed)
        return resume_meta

    def _build_data(self) -> tuple[list[dict], list[dict]]:
        """(train rows, validation rows), tokenized and checked; the run state with its prompt loader."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.path)
        # Every engine stops on the same ids: rollout.stop_token_ids and the EOS ids the model's configs
        # declare (SGLang stops on those whatever it is asked; the native engine adds the tokenizer's EOS).
        self.stop_token_ids = tuple(sorted({*cfg.rollout.stop_token_ids, *model_eos_ids(cfg.model.path)}))
        self.stop_set = {self.tokenizer.eos_token_id, *self.stop_token_ids}  # a completion's last token, cut
        # Prompt text -> token ids (chat template applied when used); each prompt is tokenized once.
        self.encode = PromptEncoder(
            self.tokenizer,
            use_chat_template(self.tokenizer, cfg.data.chat_template, cfg.model.path),
            cfg.model.path,
            cfg.data.system_prompt,
        )
        data = load_datasets(cfg.data)
        prepare = functools.partial(
            prepare_rows,
            cfg=cfg,
            encode=self.encode,
            check_rows=self.rewards.rule.check_rows,
            max_positions=self._model_config.get("max_position_embeddings"),
        )
        rows = prepare(data.train, data.train_source, "train")
        val_rows = prepare(data.val, data.val_source, "validation") if data.val else []
        val_rows = val_rows[: cfg.data.val_size]
        if cfg.trainer.val_every or cfg.trainer.val_before_train:
            if not val_rows:
                raise ValueError(
                    f"config key 'trainer.val_every' / 'trainer.val_before_train': validation needs a "
                    f"validation set; set data.val_path or data.val_split (data.task={cfg.data.task} "
                    "has none of its own)"
                )
            check_val_set(val_rows, cfg.data.val_batch_size or cfg.data.batch_size, data.val_source)
        self.rewards.probe(rows, self.tokenizer, cfg.model.path)  # and the environment, if any (issue 28)
        a = cfg.algorithm
        self.state = RunState(
            loader=PromptLoader(rows, cfg.data.batch_size, D.rank(), D.world_size(), cfg.data.seed),
            kl_ctl=(
                AdaptiveKLController(a.kl_coef, a.target_kl, a.kl_horizon)
                if a.kl_controller == "adaptive"
                else FixedKLController(a.kl_coef)
            ),
            reward_norm=self.rewards.norm,
            partial=self._partial_state(rows) if cfg.rollout.partial else None,
        )
        return rows, val_rows

    def _partial_state(self, rows: list[dict]):
        """rollout.partial's carried samples: this rank's pool (loop/partial.py), colocated or on a split rollout
        rank (its share of the batch: D is scoped to the rollout pool); on a split learner, every rollout rank's
        pool state as of the batch last trained (split/learner.py CarriedSamples: what the checkpoint holds)."""
        if self.split and not self.split.is_rollout:
            return split_roles.learner_carried()
        r = self.cfg.rollout
        groups = self.cfg.data.batch_size // D.world_size()
        return PartialRollouts(
            r.n,
            groups,
            r.partial_over,
            r.partial_stop,
            r.max_new_tokens,
            r.min_new_tokens,
            rows,
            r.partial_kv == "keep",
        )

    def _build_models(self, rows: list[dict]) -> None:
        """The offload plan, the policy and the frozen reference it starts as (only rank 0 reads the weights,
        models/fsdp.py), and the reward model."""
        cfg = self.cfg
        self._mixed = self.device.type == "cuda" and cfg.model.dtype in ("auto", "bfloat16")
        longest_prompt = max(len(self.encode(r)) for r in rows[:256])
        self.offload = decide_offload(cfg, self.device, D.world_size(), self._mixed, prompt_tokens=longest_prompt)
        as_policy = functools.partial(prepare_policy, gradient_checkpointing=cfg.model.gradient_checkpointing)
        # The reference in the inference dtype: bf16 under mixed precision, what the planner bills (models/fsdp.py)
        as_ref = functools.partial(prepare_reference, dtype=torch.bfloat16 if self._mixed else torch.float32)
        # LoRA: a frozen base (inference dtype) + fp32 adapters; its reference is the base, adapters off (_score)
        load, as_policy, dtype = policy_loading(cfg.model, as_policy, self._mixed)
        own_ref = cfg.algorithm.needs_ref_model and not cfg.model.lora.enabled
        models = load_sharded(
            cfg.model.path,
            self.device,
            self._mixed,
            cfg.model.attn_implementation,
            [as_policy, as_ref] if own_ref else [as_policy],
            load=load,
            dtype=dtype,
            mesh=self.split.mesh if self.split else None,
        )
        self.policy, self.ref = models[0], (models[1] if len(models) > 1 else None)
        self.critic = self._build_critic() if cfg.has_critic else None
        if not self.split:  # a split run's reward model lives on its rollout ranks (split/roles.py)
            self.rewards.build_model(rows[:2], self.device, self._mixed)

    def _build_critic(self) -> torch.nn.Module:
        """PPO's critic (issue 36): critic.path (default the policy's directory, with a fresh value head), built
        and sharded like the policy; fp32 master weights, bf16 compute under mixed precision."""
        cfg = self.cfg
        path = cfg.critic.path or cfg.model.path
        as_critic = functools.partial(prepare_policy, gradient_checkpointing=cfg.model.gradient_checkpointing)
        load = functools.partial(
            load_value_model, path, torch.float32, cfg.model.attn_implementation, seed=cfg.trainer.seed
        )
        (critic,) = load_sharded(
            path,
            self.device,
            self._mixed,
            cfg.model.attn_implementation,
            [as_critic],
            load=load,
            model_class=ValueModel,
            mesh=self.split.mesh if self.split else None,
        )
        return critic

    def _build_optimizer(self) -> None:
        """AdamW, its lr schedule over the run's optimizer steps, and the update's settings (the critic's too)."""
        cfg, o = self.cfg, self.cfg.optim
        self.optimizer = torch.optim.AdamW(
            trainable_parameters(self.policy), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
        total = optimizer_steps(
            cfg.trainer.total_steps,
            cfg.data.batch_size * cfg.rollout.n,
            cfg.algorithm.mini_batch_size,
            cfg.algorithm.ppo_epochs,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            functools.partial(
                lr_factor, warmup=o.warmup_steps, total=total, kind=o.lr_schedule, min_ratio=o.min_lr_ratio
            ),
        )
        self.update_settings = UpdateSettings.from_config(cfg)
        self.critic_optimizer = self.critic_scheduler = None
        if self.critic is not None:
            c = cfg.critic
            self.critic_optimizer = torch.optim.AdamW(
                self.critic.parameters(), lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay
            )
            self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.critic_optimizer,
                functools.partial(
                    lr_factor, warmup=c.lr_warmup_steps, total=total, kind=c.lr_schedule, min_ratio=c.min_lr_ratio
                ),
            )
            self.critic_settings = CriticSettings.from_config(cfg)

    def _build_engine_and_phases(self, train_rows: list[dict], val_rows: list[dict]) -> None:
        """The rollout engine and the phase switch that moves memory between it and training."""
        cfg = self.cfg
        if cfg.rollout.engine == "sglang" and self.device.type == "cuda":
            # Before the engine exists: what it will size its KV cache from is free now.
            optimizer_bytes = 8 * sum(p.numel() for p in trainable_parameters(self.policy)) // D.world_size()
            room = sglang_kv_room_warning(
                optimizer_bytes,
                torch.cuda.mem_get_info(self.device)[0],
                cfg.rollout.mem_fraction,
                self.offload.optimizer,
            )
            if room:
                warnings.warn(room)
        self.engine = self._build_engine(torch.bfloat16 if self._mixed else None, train_rows, val_rows)
        self.phases = PhaseManager(
            self.policy,
            self.optimizer,
            self.engine,
            self.device,
            ref=self.ref,
            offload_optimizer=self.offload.optimizer,
            offload_ref=self.offload.ref,
            offload_params=self.offload.params,
            bucket_bytes=cfg.rollout.bucket_mb << 20,
            lora=cfg.model.lora.enabled,
            reward_model=self.rewards.module,
            offload_reward_model=self.offload.reward_model,
            critic=self.critic,
            critic_optimizer=self.critic_optimizer,
            offload_critic=cfg.critic.offload_params,
            offload_critic_optimizer=cfg.critic.offload_optimizer,
        )

    def _build_collaborators(self, val_rows: list[dict], resume_meta: Optional[dict]) -> None:
        """The rollout stage, the checkpointer and the validator (built from the parts they use), the output
        directory and the loggers (rank 0)."""
        cfg = self.cfg
        self._closed = False
        self.out_dir = cfg.trainer.out_dir
        self.rollout_stage = RolloutStage(
            cfg,
            self.encode,
            self.rewards,
            self.tokenizer,
            self.stop_token_ids,
            self.stop_set,
            self.device,
            self.out_dir,
        )
        self.checkpointer = Checkpointer(
            cfg,
            self._model_config,
            self.policy,
            self.optimizer,
            self.scheduler,
            self.state,
            self.phases,
            self.tokenizer,
            critic=(self.critic, self.critic_optimizer, self.critic_scheduler) if self.critic is not None else None,
        )
        self.validator = Validator(
            cfg,
            val_rows,
            self.encode,
            self.rewards,
            self.tokenizer,
            self.phases,
            self.stop_token_ids,
            self.stop_set,
            self.out_dir,
        )
        self.learner_side = split_roles.learner_side(
            cfg,
            self.split,
            self.state.loader,
            self.state.loader.rows,
            self.tokenizer.pad_token_id,
            self.device,
            self._mixed,
        )
        if D.is_main():
            os.makedirs(self.out_dir, exist_ok=True)
            used, reward_line = self.rewards.recorded(cfg)  # the reward that runs, not a name it replaced
            save_config(used, os.path.join(self.out_dir, "config.yaml"), reward_line)
        resume_step = resume_meta["step"] if resume_meta else None
        self.loggers = build_loggers(cfg, console_write, resume_step) if D.is_main() else []
        ckpt.remove_stale_temporaries(cfg.trainer.checkpoint_root)

    @property
    def step_idx(self) -> int:
        """Finished steps (the run state's count)."""
        return self.state.step

    def save_checkpoint(self) -> str:
        """Write a sharded checkpoint of this step (every rank calls it, between steps); returns its path."""
        return self.checkpointer.save()

    def save_pretrained(self, path: str) -> str:
        """Save the current policy and tokenizer as a Hugging Face directory (call on every rank): a checkpoint
        of this step (written now unless one exists), exported by rank 0 (`python -m hybrid_rl.export`)."""
        return self.checkpointer.export(path)

    def _build_engine(self, weights_dtype: Optional[torch.dtype], train_rows: list[dict], val_rows: list[dict]):
        """The rollout engine: native decodes with the policy module itself; sglang and vllm keep their own copy
        (vllm sizes its context from the longest prompt, training or validation)."""
        r, tok = self.cfg.rollout, self.tokenizer
        if self.split and not self.is_rollout:
            return split_roles.learner_engine(self.policy)  # split learners hold no engine
        engine_cls = engine_class(r.engine)
        if r.engine == "sglang":
            return engine_cls(
                self.policy,
                self.cfg.model.path,
                pad_id=tok.pad_token_id,
                eos_id=tok.eos_token_id,
                tp_size=r.tp_size,
                weights_dtype=weights_dtype,
                mem_fraction=r.mem_fraction,
                seed=r.seed,
                timeout_s=r.engine_timeout_s,
                with_tokenizer=r.min_new_tokens > 0,
            )
        if r.engine == "vllm":
            from hybrid_rl.rollout.vllm.engine import build_for_trainer

            longest = max(len(self.encode(row)) for row in [*train_rows, *val_rows])
            return build_for_trainer(self.cfg, self.policy, tok, longest, bool(val_rows), weights_dtype)
        return engine_cls(
            self.policy,
            pad_id=tok.pad_token_id,
            eos_id=tok.eos_token_id,
            weights_dtype=weights_dtype,
            cuda_graphs=r.cuda_graphs,
        )

    def _build_rollout_rank(self, rows: list[dict], val_rows: list[dict]) -> None:
        """A split rollout rank: its own copy of the policy under the configured engine, the rollout stage on
        this rank's loader slice, the validator over the resident engine; no optimizer, phase switch,
        checkpointer or loggers (split/rollout_loop.py)."""
        self.policy = split_roles.load_rollout_models(self.cfg, self.split, self.device, self.rewards, rows)
        self.engine = self._build_engine(None, rows, val_rows)
        self.rollout_stage = RolloutStage(
            self.cfg,
            self.encode,
            self.rewards,
            self.tokenizer,
            self.stop_token_ids,
            self.stop_set,
            self.device,
            self.cfg.trainer.out_dir,
        )
        self.validator = Validator(
            self.cfg,
            val_rows,
            self.encode,
            self.rewards,
            self.tokenizer,
            split_roles.resident_phases(self.engine),
            self.stop_token_ids,
            self.stop_set,
            self.cfg.trainer.out_dir,
        )
        self.rollout_side = split_roles.rollout_side(
            self.cfg,
            self.split,
            self.rollout_stage,
            self.engine,
            self.state.loader,
            rows,
            self.validator,
            self.policy,
            pool=self.state.partial,
        )
        self._closed, self.loggers, self.checkpointer = False, [], split_roles.RolloutCheckpoints()

    # -- one step -------------------------------------------------------------
    def step(self) -> dict:
        """One GRPO step; its metrics. After an exception (a failing reward, an out-of-memory error, Ctrl-C in a
        notebook) the phase switch is back in TRAIN and the loader at the step's first batch: step() retries it."""
        if self._closed:
            raise RuntimeError(
                "this Trainer is closed (close() ran, or a signal stopped fit() after its checkpoint); "
                "build a new Trainer(cfg): trainer.resume=auto continues from the newest checkpoint"
            )
        loader, loader_state = self.state.loader, self.state.loader.state_dict()
        pool = self.state.partial
        # state_dict() builds new lists; the kept caches it refers to are never written in place, so no deep copy (a
        # copy of every carried sample's cache per step, rollout.partial_kv=keep).
        pool_state = pool.state_dict() if pool is not None else None

        def undo() -> None:  # the step's prompts and carried samples as they were before it
            loader.load_state_dict(loader_state)
            if pool is not None:
                pool.load_state_dict(pool_state)

        where = lambda: (self.state.step + 1, self.phases.failed_phase or self.phases.phase)  # for failure_line
        with D.failure_context(where), self.phases.recovering(undo=undo):
            return self._step()

    def _step(self) -> dict:
        """ROLLOUT -> REWARD -> SCORE -> ADVANTAGE -> TRAIN -> metrics (module docstring)."""
        timer = StageTimer()
        kl_coef = self.state.kl_ctl.value  # this step's coefficient, whatever the step measures
        with timer("step"):
            # Generation and rewards share one ROLLOUT phase: dynamic sampling may need
            # several rounds, and the engine's memory should be switched in once per step.
            with self.phases.rollout() as engine:
                if self.split:  # batch `step` from the rollout ranks, this learner's share (split/learner.py)
                    batch, metrics = self.learner_side.batch(self.state.step, timer)
                elif self.state.partial is not None:  # rollout.partial: carried samples continue (loop/partial.py)
                    batch, metrics = self.rollout_stage.run_partial(
                        engine, self.state.partial, self.state.loader, self.state.step, timer, self.phases.reward
                    )
                else:
                    batch, metrics = self.rollout_stage.run(
                        engine, self.state.loader, self.state.step, timer, model_phase=self.phases.reward
                    )
            if batch is not None:
                with self.phases.score() as ref, timer("score"):
                    old_logp_NT, ref_logp_NT = self._score(batch, ref)
                    values_NT = self._values(batch)
                with timer("advantage"):
                    train_batch, shaping = advantage_stage(
                        batch, old_logp_NT, ref_logp_NT, kl_coef, self.cfg.algorithm, values_NT=values_NT
                    )
                with self.phases.train() as optimizer, timer("train"):  # a new mini-batch shuffle every step
                    metrics.update(
                        self._update(optimizer, train_batch, kl_coef, seed=self.cfg.trainer.seed + self.state.step)
                    )
                metrics.update(shaping.reduce())
                metrics["actor/kl_coef"] = kl_coef
                if "actor/kl_ref" in metrics:
                    # Ziegler et al.: the measured KL and the number of samples since the last update.
                    self.state.kl_ctl.update(metrics["actor/kl_ref"], len(batch) * D.world_size())
            else:
                # Every rank agreed that no group is informative: nothing to train on this step.
                with self.phases.train():
                    pass
            if self.split:  # the batches made before version step + 1 is needed, then its weights
                metrics.update(self.learner_side.after_update(self.policy, self.state.step + 1, batch))
        metrics.update(step_time_metrics(timer, self.phases.pop_stats()))
        if self.split:
            metrics.update(self.learner_side.rates(metrics))
        metrics.update(self.phases.ledger.rollout_metrics(self.phases.rollouts))
        snaps = self.phases.ledger.rollout_snapshots(self.phases.rollouts)
        metrics.update(phase_memory((s.label, s.total) for s in snaps))  # the dashboard's memory over the run
        self.state.ledger_rollout = self.phases.rollouts
        self.state.step += 1
        metrics["step"] = self.state.step
        metrics["bottleneck"] = bottleneck(metrics)
        return metrics

    # -- SCORE ----------------------------------------------------------------
    def _update(self, optimizer: torch.optim.Optimizer, batch, kl_coef: float, seed: int) -> dict:
        """TRAIN: the actor's update (not while PPO's critic warms up: critic.warmup_steps), then the critic's over
        the same mini-batches (the same seed gives the same rows)."""
        metrics = {}
        if self.critic is None or self.state.step >= self.cfg.critic.warmup_steps:
            metrics.update(
                policy_update(
                    policy=self.policy,
                    optimizer=optimizer,
                    scheduler=self.scheduler,
                    batch=batch,
                    settings=self.update_settings,
                    kl_coef=kl_coef,
                    seed=seed,
                )
            )
        if self.critic is not None:
            metrics.update(
                critic_update(
                    critic=self.critic,
                    optimizer=self.critic_optimizer,
                    scheduler=self.critic_scheduler,
                    batch=batch,
                    settings=self.critic_settings,
                    seed=seed,
                )
            )
            metrics["critic/warmup"] = float(self.state.step < self.cfg.critic.warmup_steps)
        return metrics

    def _values(self, batch: RolloutBatch) -> Optional[torch.Tensor]:
        """SCORE: the critic's values of the batch's response tokens (PPO), None without a critic."""
        if self.critic is None:
            return None
        tc = self.cfg.trainer
        return score_values(
            self.critic,
            batch.ids_NL,
            batch.attn_NL,
            batch.P,
            tc.micro_batch_size,
            tc.max_tokens_per_micro_batch,
            batch.group_size,
            packing=tc.packing,
        )

    def _score(self, batch: RolloutBatch, ref: Optional[torch.nn.Module]):
        """(old_logp_NT or None, ref_logp_NT or None) for the batch's response tokens."""
        tc = self.cfg.trainer

        def score(model):
            return score_logprobs(
                model,
                batch.ids_NL,
                batch.attn_NL,
                batch.P,
                self.cfg.rollout.temperature,
                tc.micro_batch_size,
                tc.max_tokens_per_micro_batch,
                tc.packing,
                batch.group_size,
            )

        # split with k > 0, or carried samples (rollout.partial): the batch's generating weights are not all the
        # policy's, the recompute is pi_old
        stale = (bool(self.split) and self.cfg.trainer.max_staleness > 0) or self.cfg.rollout.partial
        old = (
            score(self.policy) if stale or scores_old_policy(self.cfg.algorithm, len(batch) * D.world_size()) else None
        )
        if ref is None and self.cfg.model.lora.enabled and self.cfg.algorithm.needs_ref_model:
            with adapters_disabled(self.policy):  # the reference: the base, to the bit
                return old, score(self.policy)
        return old, score(ref) if ref is not None else None

    # -- metrics --------------------------------------------------------------
    def close(self) -> None:
        """Close the loggers and stop the rollout engine's processes, if it has any (SGLang). The trainer
        refuses to step after (its engine and loggers are gone); closing twice is harmless."""
        self._closed = True
        for logger in self.loggers:
            logger.close()
        self.loggers = []
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def _log(self, metrics: dict) -> None:
        for logger in self.loggers:  # rank 0 only: the other ranks have none
            logger.log(metrics, metrics["step"])

    # -- the loop -------------------------------------------------------------
    def fit(self, steps: Optional[int] = None) -> list[dict]:
        """Run `steps` more steps (default: up to trainer.total_steps); returns the metrics history.

        SIGTERM / SIGINT finish the current step, write a checkpoint, close the loggers and
        raise `TrainingInterrupted` (an ordinary exception naming the checkpoint and how to continue; a recipe
        exits with status 128 + signal); a second signal stops at once. Checkpoints every `trainer.save_every`
        steps and after the last one."""
        from tqdm.auto import tqdm

        t, state = self.cfg.trainer, self.state
        total = steps if steps is not None else t.total_steps - state.step
        if self.is_rollout:  # learner rank 0 says which batches to make (split/rollout_loop.py)
            return split_roles.rollout_fit(self.rollout_side, state.history)
        validate = self.validator.run
        if self.split:  # validation runs on the rollout ranks (split/validation.py)
            self.learner_side.start(
                state.step, max(total, 0), state.loader.state_dict(), self.policy, state.reward_norm, state.partial
            )
            validate = functools.partial(self.learner_side.validate, self.policy, self.validator.write_samples)
        if total <= 0 and D.is_main():
            print(
                f"nothing to do: the run is at step {state.step} of trainer.total_steps={t.total_steps}"
                + (
                    f" (resumed from {self.resume_from}); raise total_steps, or start over in another trainer.out_dir"
                    if self.resume_from
                    else ""
                )
            )
        show = D.is_main() and t.progress_bar and interactive()
        bar = tqdm(total=max(total, 0), disable=not show, desc="grpo", dynamic_ncols=True)
        stop = StopSignal()
        interrupted: Optional[TrainingInterrupted] = None
        try:
            with D.failure_context(lambda: (state.step, self.phases.failed_phase or self.phases.phase)):
                if t.val_before_train and state.step == 0:
                    self._log({"step": 0, **validate(0)})
                for i in range(total):
                    m = self.step()
                    if t.val_every and (state.step % t.val_every == 0 or i == total - 1):
                        m.update(validate(state.step))
                    state.history.append(m)
                    self._log(m)
                    bar.set_postfix(reward=f"{m['reward/mean']:.3f}")
                    bar.update()
                    signum = stop.agreed() or (self.learner_side.signal if self.split else 0)
                    if signum or (t.save_every and (state.step % t.save_every == 0 or i == total - 1)):
                        path = self.save_checkpoint()
                    if signum:
                        if self.split:  # the rollout ranks end now, not at their timeout
                            self.learner_side.stop(state.step)
                        self.close()
                        interrupted = TrainingInterrupted(signum, state.step, path)
                        raise interrupted
                if self.split:  # trainer.inflight_update=continue: the versions still queued reach the rollout ranks
                    self.learner_side.finish()
        except BaseException as err:
            if self.split and err is not interrupted:  # a failure: continue's senders end, not at a timeout
                self.learner_side.abandon()
            raise
        finally:
            stop.restore()
            bar.close()
            if D.is_main() and state.history:  # the curve and split of the whole run, a resumed one too
                whole = run_history(self.out_dir, state.history)
                draw_run(whole, self.out_dir)  # dashboard.png, reward_curve.png
                self.phases.ledger.write_report(state.ledger_rollout, self.out_dir, self.offload.message)
                print(split_summary(whole))
            if interrupted is not None:  # last: under torchrun only torchrun's report of the signal follows
                interrupted.announce()
        return state.history
