"""Configuration schema: the single source of truth for every setting.

Dataclasses with defaults, validated in `__post_init__` (a bad value raises
`ValueError` naming the key; config/checks.py). A key whose value is one of a fixed
set of strings is annotated `Literal[...]`, and `check_choices` reads the allowed values
from that annotation: adding a choice is editing the annotation, nothing else. Merging
a YAML file, `key.sub=value` overrides and presets onto the schema is config/load.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, Union

from hybrid_rl.config.checks import check, check_choices, clip_bound, one_of, strict_sections

# `model.lora.*`: what the keys do is models/lora.py (peft); the checks that need the model's layers or the
# engine run before a model is built (loop/preflight.py).
LORA_ALL_LINEAR = "all-linear"
# trainer.dist_timeout_s: null (Config.process_group_timeout_s). The floor is torch's default for gloo groups and
# accelerate's for every group: start-up, a checkpoint write and a first compile also sit between collectives. The
# bound on one decode step is a slow one: a large batch of a large model decodes a token in 20-100 ms on a GPU
# (batches the native engine splits for memory run one after the other), so a rollout's every token at 250 ms
# still ends well inside the timeout; 32k new tokens get 8192 s.
DIST_TIMEOUT_FLOOR_S = 1800
DECODE_STEP_BOUND_MS = 250


@dataclass
class LoraSettings:
    """`model.lora.*`, LoRA through peft (models/lora.py). rank 0 = LoRA off (the whole policy trains)."""

    rank: int = 0
    alpha: float = 32.0  # peft's lora_alpha: the update is scaled by alpha / rank
    # Applied in the update only (train mode); scoring runs in eval mode, so a non-zero value biases the
    # PPO ratio the way model dropout would (models/fsdp.py prepare_policy). verl's default is 0.
    dropout: float = 0.0
    # "all-linear" (every Linear but the LM head, as peft) or a list of module names, e.g. [q_proj, v_proj]
    target_modules: Union[str, list[str]] = LORA_ALL_LINEAR

    def __post_init__(self) -> None:
        check(
            isinstance(self.rank, int) and self.rank >= 0,
            "model.lora.rank",
            f"must be an integer >= 0 (0 = off), got {self.rank!r}",
        )
        check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha!r}")
        check(0.0 <= self.dropout < 1.0, "model.lora.dropout", f"must be in [0, 1), got {self.dropout!r}")
        tm = self.target_modules
        if isinstance(tm, str):
            check(
                tm == LORA_ALL_LINEAR,
                "model.lora.target_modules",
                f"a string must be {LORA_ALL_LINEAR!r}; got "
                f"{tm!r} (give a list of module names, e.g. [q_proj, v_proj])",
            )
            return
        tm = list(tm)
        check(
            len(tm) > 0 and all(isinstance(t, str) and t for t in tm),
            "model.lora.target_modules",
            f"must be {LORA_ALL_LINEAR!r} or a non-empty list of module names, got {tm!r}",
        )
        check(len(set(tm)) == len(tm), "model.lora.target_modules", f"lists a name twice: {tm!r}")
        self.target_modules = tm

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ModelConfig:
    path: str = ""  # local Hugging Face directory (config.json + safetensors + tokenizer)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # "auto": bf16 mixed precision on CUDA, fp32 on CPU
    # Recompute each decoder layer in backward (non-reentrant, FSDP2-safe). The policy always trains with its
    # dropout forced off (models/fsdp.py prepare_policy): the update's log-probs must be the old policy's.
    gradient_checkpointing: bool = False
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    # LoRA (issue 29): a frozen base + fp32 adapters; the reference is the base (adapters off), the sync adapter-only
    lora: LoraSettings = field(default_factory=LoraSettings)

    def __post_init__(self) -> None:
        check_choices(self, "model")


DataTask = Literal["digits", "gsm8k", "jsonl", "parquet"]


@dataclass
class DataConfig:
    """Where prompts come from, how they become token ids, and the validation set (data/prompts.py)."""

    task: DataTask = "digits"  # digits: generated; jsonl, parquet: a local file of rows
    # jsonl/parquet: the training file. gsm8k: a directory holding train/test .jsonl (or .parquet);
    # "" = ../shared/data/gsm8k beside the repository if present, else openai/gsm8k through `datasets`.
    path: str = ""
    # jsonl/parquet: the row key holding the prompt, a string or a list of chat messages (gsm8k: always "question").
    # Keys may be dotted for nested fields, e.g. answer_key=reward_model.ground_truth for verl's parquet files.
    prompt_key: str = "prompt"
    answer_key: str = ""  # jsonl/parquet: the row key of the reference answer, given to rewards as "answer"; "" = none
    # Appended to each prompt (a conversation's last user turn) after a space; null = the task's own, "" = none.
    instruction: Optional[str] = None
    system_prompt: str = ""  # with a chat template: a system turn opening every conversation that has none; "" = none
    batch_size: int = 32  # prompts per step, over all ranks
    num_prompts: Optional[int] = None  # digits: how many to generate (null = 4096); else the first N rows (null = all)
    max_prompt_tokens: int = 0  # longer prompts (chat template included) are dropped, counted in the log; 0 = no limit
    chat_template: Optional[bool] = None  # null: wrap prompts when the tokenizer has a template; true: require it
    val_path: str = ""  # jsonl/parquet validation file; gsm8k uses its test split unless this is set
    val_split: float = 0.0  # without val_path (not gsm8k): this fraction of the rows is held out to validate on
    val_size: Optional[int] = None  # validate on the first N validation prompts that fit max_prompt_tokens (null = all)
    val_batch_size: Optional[int] = None  # validation prompts per generate call, over all ranks (null = batch_size)
    seed: int = 0

    def __post_init__(self) -> None:
        check_choices(self, "data")
        check(self.batch_size > 0, "data.batch_size", f"must be > 0, got {self.batch_size}")
        check(
            self.num_prompts is None or self.num_prompts > 0,
            "data.num_prompts",
            f"must be > 0 (or null), got {self.num_prompts}",
        )
        if self.task in ("jsonl", "parquet"):
            check(bool(self.path), "data.path", f"is required when data.task={self.task}")
        check(bool(self.prompt_key), "data.prompt_key", "is empty; name the row key that holds the prompt")
        check(
            self.max_prompt_tokens >= 0,
            "data.max_prompt_tokens",
            f"must be >= 0 (0 = no limit), got {self.max_prompt_tokens}",
        )
        check(0.0 <= self.val_split < 1.0, "data.val_split", f"must be in [0, 1), got {self.val_split}")
        check(
            self.val_size is None or self.val_size > 0, "data.val_size", f"must be > 0 (or null), got {self.val_size}"
        )
        check(
            self.val_batch_size is None or self.val_batch_size > 0,
            "data.val_batch_size",
            f"must be > 0 (or null: data.batch_size), got {self.val_batch_size}",
        )


# tests/unit/config/test_config.py checks this against rollout/base.py's table of engine classes.
Engine = Literal["native", "sglang", "vllm"]


@dataclass
class RolloutConfig:
    engine: Engine = (
        "native"  # native (torch, the policy's own weights) | sglang (GPU extra) | vllm (extra [vllm]); own weights
    )
    n: int = 8  # samples per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 16
    min_new_tokens: int = (
        0  # no stop before this many tokens (vLLM min_tokens, SGLang min_new_tokens); not in validation
    )
    # Extra stops: the tokenizer's EOS and every eos_token_id of the model's configs always stop.
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    tp_size: int = 1  # sglang, vllm: ranks per inference engine (tensor parallel); divides the ranks of a node
    mem_fraction: Optional[float] = (
        None  # sglang: mem_fraction_static; vllm on CUDA: gpu_memory_utilization; null = default
    )
    kv_cache_bytes: Optional[int] = None  # vllm: KV bytes per rank; null = one batch's need (planner's formula; README)
    enable_prefix_caching: bool = False  # vllm: reuse the KV of shared prompt prefixes (off: a sync would stale it)
    enforce_eager: Optional[bool] = None  # vllm: null = eager on CPU, graphs on CUDA; false compiles on CPU (README)
    # native: the lean decode step replayed as CUDA graphs. null = on CUDA where the lean step runs; false = eager
    # (graphs read every cache slot of the longest row each step and are captured per batch: at large batches eager
    # can win, benchmarks/gpu_session.sh measures both); true = required (an error where they cannot run)
    cuda_graphs: Optional[bool] = None
    bucket_mb: int = 512  # weight sync: size of one flat bucket (peak extra memory of a sync)
    # sglang: how long the other ranks of an engine's group wait on its owner (a whole rollout's generate)
    engine_timeout_s: int = 3600
    max_turns: int = 4  # with env.*: model turns per episode at most (each a generate call of <= max_new_tokens)
    max_episode_tokens: int = 1024  # with env.*: prompt + every turn + every observation, at most
    # Partial rollouts (loop/partial.py, docs/partial_rollouts.md): a rollout stops once enough groups have finished;
    # the unfinished samples are carried, with their tokens, log-probs and versions, and continued in the next one
    partial: bool = False
    partial_over: float = 1.5  # groups in flight per rank: ceil(partial_over x the rank's data.batch_size groups)
    partial_stop: float = 1.0  # stop once this fraction of the rank's data.batch_size groups have every sample done
    # What a carried sample's next rollout starts from (native engine): its prompt and prefix recomputed under the new
    # weights (AReaL's interrupted requests), or the keys and values the older weights wrote, held on the host between
    # rollouts and saved with checkpoints (keep: PipelineRL's in-flight update, across steps; no re-prefill)
    partial_kv: Literal["recompute", "keep"] = "recompute"

    def __post_init__(self) -> None:
        check_choices(self, "rollout")
        check(self.partial_over >= 1, "rollout.partial_over", f"must be >= 1, got {self.partial_over}")
        check(0 < self.partial_stop <= 1, "rollout.partial_stop", f"must be in (0, 1], got {self.partial_stop}")
        check(self.max_turns >= 1, "rollout.max_turns", f"must be >= 1, got {self.max_turns}")
        check(
            self.max_episode_tokens >= 2, "rollout.max_episode_tokens", f"must be >= 2, got {self.max_episode_tokens}"
        )
        check(self.n >= 1, "rollout.n", f"must be >= 1, got {self.n}")  # >= 2 for group baselines: Config checks it
        check(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k > 0, "rollout.top_k", f"must be -1 (off) or > 0, got {self.top_k}")
        check(self.max_new_tokens > 0, "rollout.max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "rollout.min_new_tokens",
            f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
        )
        one_of(self.tp_size, "rollout.tp_size", [1, 2, 4, 8])
        check(
            self.engine in ("sglang", "vllm") or self.tp_size == 1,
            "rollout.tp_size",
            f"tensor-parallel inference needs rollout.engine=sglang or vllm (got {self.engine!r})",
        )
        check(
            self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
            "rollout.kv_cache_bytes",
            f"must be > 0 or null (sized from the batch), got {self.kv_cache_bytes}",
        )
        check(
            self.mem_fraction is None or 0 < self.mem_fraction < 1,
            "rollout.mem_fraction",
            f"must be in (0, 1) or null, got {self.mem_fraction}",
        )
        check(self.bucket_mb > 0, "rollout.bucket_mb", f"must be > 0, got {self.bucket_mb}")
        check(self.engine_timeout_s > 0, "rollout.engine_timeout_s", f"must be > 0, got {self.engine_timeout_s}")
        check(
            self.cuda_graphs is None or self.engine == "native",
            "rollout.cuda_graphs",
            f"is the native engine's (rollout.engine={self.engine!r}); vLLM's is rollout.enforce_eager, SGLang "
            "captures its own",
        )


ClipBound = Optional[Union[int, float, str]]  # a number, null (that side off) or "auto"
# Names of the tables in hybrid_rl/algorithms/ (presets.PRESETS, advantages.ADVANTAGE_ESTIMATORS, ...), written
# out rather than built from them: the schema stays importable without torch and readable by a type checker.
# tests/unit/config/test_config.py checks each against its table, so a name added to one and not the other fails there.
Preset = Literal["", "dapo", "drgrpo", "grpo", "gspo"]
AdvantageName = Literal["drgrpo", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
PolicyLoss = Literal["cispo", "gspo", "ppo_clip"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
Correction = Literal["none", "tis_token", "tis_seq", "mis_token", "mis_seq"]


@dataclass
class AlgorithmConfig:
    """What is optimised: advantage, loss, KL, entropy, rollout correction, DAPO tricks.

    `preset` names a published method (hybrid_rl/algorithms/presets.py); `load_config`
    expands it to its keys in the layer that names it, so explicit keys still win.
    Built in Python, use `AlgorithmConfig.from_preset(name, **overrides)`; the
    constructor itself only records the name (and refuses a named preset none of whose
    own values is set).
    """

    preset: Preset = ""  # "" = none
    advantage: AdvantageName = "grpo"
    policy_loss: PolicyLoss = "ppo_clip"
    loss_agg: LossAgg = "token-mean"
    # "auto": the policy loss's own bounds (ppo_clip 0.2/0.2, gspo 3e-4/4e-4, cispo null/0.2); null: no bound.
    clip_ratio_low: ClipBound = "auto"
    clip_ratio_high: ClipBound = "auto"
    clip_ratio_c: Optional[float] = None  # dual clip for negative advantages (ppo_clip)
    kl_placement: Literal["loss", "reward", "none"] = "loss"  # loss: a term in the loss | reward: penalty on the reward
    kl_coef: float = 0.0  # KL to the reference model; 0 = no KL and no reference model
    kl_estimator: KLEstimator = "k3"
    kl_controller: Literal["fixed", "adaptive"] = (
        "fixed"  # adaptive: coef tracks target_kl (Ziegler 2019), either placement
    )
    target_kl: float = 0.1  # adaptive controller: the per-token KL to hold
    kl_horizon: int = 10000  # adaptive controller: horizon in sequences
    entropy_coef: float = 0.0  # entropy bonus in the loss
    rollout_correction: Correction = "none"  # engine/trainer mismatch
    correction_cap: float = 2.0  # upper bound on the importance ratio
    correction_lower: Optional[float] = None  # lower bound; null: 1/cap for MIS, none for TIS
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more prompts
    max_sampling_rounds: int = 3  # generation rounds per step at most, the first included
    overlong_filter: bool = False  # DAPO: truncated completions leave the loss
    overlong_penalty_factor: float = 0.0  # DAPO soft overlong penalty; 0 = off
    overlong_buffer_len: Optional[int] = None  # tokens before max_new_tokens where it ramps; null = a fifth
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # sequences per optimizer step over all ranks; 0 = the whole batch
    adv_eps: float = 1e-6
    gamma: float = 1.0  # discount of the token-level returns (reinforce_pp, gae); 1 = undiscounted, as in the paper
    lam: float = 1.0  # GAE's lambda (advantage=gae, PPO with a critic): 1 = Monte Carlo returns less the value

    def __post_init__(self) -> None:
        from hybrid_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS

        check_choices(self, "algorithm")
        check_preset_applied(self)
        # "auto" stays (the schema's default instance must not bake in one loss's bounds); clip_bounds() resolves it.
        self.clip_ratio_low = clip_bound(self.clip_ratio_low, "algorithm.clip_ratio_low")
        self.clip_ratio_high = clip_bound(self.clip_ratio_high, "algorithm.clip_ratio_high")
        check(self.clip_ratio_c is None or self.clip_ratio_c > 1, "algorithm.clip_ratio_c", "must be > 1 (or null)")
        check(self.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
        check(self.target_kl > 0, "algorithm.target_kl", f"must be > 0, got {self.target_kl}")
        check(self.kl_horizon > 0, "algorithm.kl_horizon", f"must be > 0 (sequences), got {self.kl_horizon}")
        check(self.entropy_coef >= 0, "algorithm.entropy_coef", "must be >= 0 (a bonus: the loss subtracts it)")
        check(self.correction_cap > 0, "algorithm.correction_cap", f"must be > 0, got {self.correction_cap}")
        check(
            self.correction_lower is None or 0 < self.correction_lower < self.correction_cap,
            "algorithm.correction_lower",
            f"must be in (0, correction_cap={self.correction_cap}) or null",
        )
        check(
            self.max_sampling_rounds >= 1,
            "algorithm.max_sampling_rounds",
            f"must be >= 1 (1 = filter only, never sample again), got {self.max_sampling_rounds}",
        )
        check(self.overlong_penalty_factor >= 0, "algorithm.overlong_penalty_factor", "must be >= 0 (0 = off)")
        check(
            self.overlong_buffer_len is None or self.overlong_buffer_len >= 0,
            "algorithm.overlong_buffer_len",
            "must be >= 0 or null (a fifth of rollout.max_new_tokens)",
        )
        check(self.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be >= 1")
        check(self.mini_batch_size >= 0, "algorithm.mini_batch_size", "must be >= 0 (0 = whole batch)")
        check(0 <= self.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {self.gamma}")
        check(
            self.gamma == 1 or ADVANTAGE_ESTIMATORS[self.advantage].discounted,
            "algorithm.gamma",
            f"a discount needs token-level returns: set algorithm.advantage=reinforce_pp or gae "
            f"(got {self.advantage!r})",
        )
        check(0 <= self.lam <= 1, "algorithm.lam", f"must be in [0, 1], got {self.lam}")
        check(
            self.lam == 1 or ADVANTAGE_ESTIMATORS[self.advantage].critic,
            "algorithm.lam",
            f"is GAE's lambda: set algorithm.advantage=gae (got {self.advantage!r})",
        )

    def clip_bounds(self) -> tuple[Optional[float], Optional[float]]:
        """(low, high) clip ratios for the policy loss; "auto" is that loss's own default, None no bound."""
        from hybrid_rl.algorithms.presets import LOSS_CLIP_DEFAULTS

        default_low, default_high = LOSS_CLIP_DEFAULTS.get(self.policy_loss, (0.2, 0.2))
        low = default_low if self.clip_ratio_low == "auto" else self.clip_ratio_low
        high = default_high if self.clip_ratio_high == "auto" else self.clip_ratio_high
        return low, high

    @property
    def needs_ref_model(self) -> bool:
        """A reference model is built (and scored) only when a KL term will use it."""
        return self.kl_placement != "none" and self.kl_coef > 0

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "AlgorithmConfig":
        """The preset's values, then `overrides` (the Python form of `algorithm.preset=name`)."""
        from hybrid_rl.algorithms.presets import preset_values

        try:
            values = preset_values(name)
        except ValueError as err:
            raise ValueError(f"config key 'algorithm.preset': {err}") from None
        return cls(**{**values, "preset": name, **overrides})


def check_preset_applied(algo: AlgorithmConfig) -> None:
    """`AlgorithmConfig(preset="dapo")` records the name only: refuse it when none of the preset's own
    values (those that differ from the defaults) is set, instead of silently running the defaults."""
    if not algo.preset:
        return
    from hybrid_rl.algorithms.presets import preset_values

    defaults = {f.name: f.default for f in fields(algo)}
    distinctive = {k: v for k, v in preset_values(algo.preset).items() if v != defaults[k]}
    if distinctive and all(getattr(algo, k) == defaults[k] for k in distinctive):
        raise ValueError(
            f"config key 'algorithm.preset': {algo.preset!r} is named but none of its values "
            f"({', '.join(f'{k}={v!r}' for k, v in sorted(distinctive.items()))}) is set: the constructor "
            f"records the name only. Use AlgorithmConfig.from_preset({algo.preset!r}, ...) in Python, or "
            f"algorithm.preset={algo.preset} in a YAML or an override"
        )


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0  # optimizer steps of linear warm-up from lr / warmup_steps to lr
    # After warm-up: "constant", or "cosine" / "linear" decay to lr * min_lr_ratio at the last
    # optimizer step of trainer.total_steps (loop/lr_schedule.py).
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_choices(self, "optim")
        check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", "must be two values in [0, 1)"
        )
        check(self.grad_clip > 0, "optim.grad_clip", "must be > 0")
        check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")


@dataclass
class OffloadConfig:
    """What leaves the compute device outside the phase that uses it (switch/offload.py)."""

    optimizer: bool = False  # optimizer state on host outside TRAIN
    ref: bool = True  # reference model on host outside SCORE
    # Policy parameter shards on host during ROLLOUT, for an engine with its own weight copy; the
    # native engine decodes with the policy's own weights, so there it warns and is ignored.
    params: bool = False
    reward_model: bool = False  # reward model (reward.model_path) on host outside the REWARD stage
    auto: bool = False  # ignore the flags above and take the planner's advice (python -m hybrid_rl.plan)


@dataclass
class CriticConfig:
    """`critic.*`: PPO's value model (algorithm.advantage=gae; issue 36), a second trainable FSDP2 model with its
    own AdamW. Any value set here with another estimator is refused (Config.__post_init__)."""

    path: str = ""  # the critic's model directory; "" = the policy's, with a fresh value head (as verl does)
    lr: float = 1e-5  # verl's PPO examples: critic 1e-5 against an actor's 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    lr_warmup_steps: int = 0  # optimizer steps of linear lr warm-up (the critic's own)
    min_lr_ratio: float = 0.0
    cliprange_value: Optional[float] = 0.5  # |V - V_old| clip of the value loss (verl's default); null = none
    warmup_steps: int = 0  # steps that train the critic only: the actor is not updated (verl's critic_warmup)
    offload_params: bool = False  # critic weights on host outside SCORE and TRAIN (during ROLLOUT)
    offload_optimizer: bool = False  # critic optimizer state on host outside TRAIN

    def __post_init__(self) -> None:
        check_choices(self, "critic")
        check(self.lr > 0, "critic.lr", f"must be > 0, got {self.lr}")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "critic.betas",
            "must be two numbers in [0, 1)",
        )
        check(self.eps > 0, "critic.eps", "must be > 0")
        check(self.weight_decay >= 0, "critic.weight_decay", "must be >= 0")
        check(self.grad_clip > 0, "critic.grad_clip", f"must be > 0, got {self.grad_clip}")
        check(self.lr_warmup_steps >= 0, "critic.lr_warmup_steps", "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "critic.min_lr_ratio", "must be in [0, 1]")
        check(
            self.cliprange_value is None or self.cliprange_value > 0,
            "critic.cliprange_value",
            f"must be > 0 or null (no clip), got {self.cliprange_value}",
        )
        check(self.warmup_steps >= 0, "critic.warmup_steps", "must be >= 0 (steps that train the critic only)")


@dataclass
class RewardConfig:
    name: str = "digits"  # a registered reward function (built in: digits, gsm8k, gsm8k_format)
    fn: str = ""  # package.module:function, imported at start-up; used instead of `name`
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments, e.g. gsm8k's mode, format_score
    success_threshold: Optional[float] = None  # reward counted as correct (accuracy); null = the function's own (1.0)
    # A learned reward model (rewards/model.py): a local HF directory with its own tokenizer, scored in
    # the REWARD stage of the phase switch. "" = none.
    model_path: str = ""
    score_index: int = -1  # classifier: the label whose logit is the reward; -1 = the only label
    score_token: str = ""  # causal LM reward model: the token whose logit at the last position is the reward
    score_token_id: int = -1  # ... or its id (-1 = unset)
    max_tokens_per_micro_batch: int = 8192  # padded tokens per reward-model forward
    # Parts of the reward and their weights: {rule: w, model: w}; a part with weight 0 is computed and
    # logged only. Empty: the rule reward alone, or the model alone when model_path is set.
    weights: dict[str, float] = field(default_factory=dict)
    normalize_model: bool = False  # standardise model scores by their running mean/std before weighting

    def __post_init__(self) -> None:
        check(bool(self.name) or bool(self.fn), "reward.name", "is empty (and reward.fn is not set)")
        check(
            not self.fn or (":" in self.fn and all(self.fn.partition(":")[::2])),
            "reward.fn",
            f"{self.fn!r} is not of the form package.module:function",
        )
        unknown = sorted(set(self.weights) - {"rule", "model", "env"})
        check(not unknown, "reward.weights", f"unknown part(s) {unknown}; the parts are 'rule', 'model' and 'env'")
        for part, w in self.weights.items():
            check(
                isinstance(w, (int, float)) and w == w and abs(w) != float("inf"),
                f"reward.weights.{part}",
                f"must be a finite number, got {w!r}",
            )
        check(
            not self.weights or any(w != 0 for w in self.weights.values()),
            "reward.weights",
            f"every weight is 0 ({dict(self.weights)}); nothing would be trained on",
        )
        has_model = bool(self.model_path)
        check(
            has_model or "model" not in self.weights,
            "reward.weights",
            "has a 'model' weight but reward.model_path is empty; set reward.model_path to a reward model directory",
        )
        check(
            not has_model or not self.weights or "model" in self.weights,
            "reward.weights",
            f"{dict(self.weights)} has no 'model' weight although reward.model_path is set; add reward.weights.model",
        )
        check(
            has_model or not self.normalize_model,
            "reward.normalize_model",
            "normalises the reward model's score, but reward.model_path is empty",
        )
        check(
            self.max_tokens_per_micro_batch > 0,
            "reward.max_tokens_per_micro_batch",
            f"must be > 0, got {self.max_tokens_per_micro_batch}",
        )
        check(
            self.score_index >= -1,
            "reward.score_index",
            f"must be >= 0 (or -1: the only label), got {self.score_index}",
        )
        check(
            self.score_token_id >= -1,
            "reward.score_token_id",
            f"must be >= 0 (or -1: unset), got {self.score_token_id}",
        )


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb"]


@dataclass
class TrainerConfig:
    total_steps: int = 100
    micro_batch_size: int = 64  # sequences per forward/backward on one rank
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches by a token budget (sequences grouped by length)
    packing: bool = True  # padding-free forward/backward (models/packing.py); false: every row padded to the longest
    out_dir: str = "runs/default"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Seconds a rank waits in a collective before the job fails (every process group). A rank that finishes its
    # rollout first waits in the next collective for the slowest one's, so null derives it from the rollout:
    # Config.process_group_timeout_s (docs/failures.md). A number fixes it.
    dist_timeout_s: Optional[int] = None
    # CPU device: glibc malloc keeps freed activation buffers for the next step instead of
    # unmapping them and page-faulting them back (runtime/host_malloc.py); resident memory stays at its peak.
    keep_host_memory: bool = True
    progress_bar: bool = True  # shown only in an interactive terminal (never written into a log file)
    log_every: int = 1  # one console line every N steps (0 = none)
    # metrics.jsonl is always written; add tensorboard (out_dir/tensorboard) and/or wandb (when installed).
    loggers: list[LoggerName] = field(default_factory=lambda: ["console"])
    project: str = "hybrid_rl"  # wandb project
    experiment: str = ""  # wandb run name; "" = the last part of out_dir
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # offline: no network needed; `wandb sync` later
    val_every: int = 0  # validate every N steps and after the last one; 0 = never
    val_before_train: bool = False  # also validate the initial policy (step 0)
    val_n: int = 0  # k > 0: also k sampled completions per prompt at rollout.temperature, logged as val/mean@k
    val_sample_rows: int = 8  # prompts (with completions and rewards) written to val_samples.jsonl per validation
    log_rollouts: int = 0  # training completions of rank 0 written to rollouts.jsonl per step (TRL's log_completions)
    # Checkpoints (checkpoint/sharded.py): sharded, written between steps, visible only when complete.
    save_every: int = 0  # a checkpoint every N steps and after the last one; 0 = only on a signal or save_pretrained
    keep_last: int = 2  # complete checkpoints kept (older ones deleted); 0 = keep all
    checkpoint_dir: str = ""  # "" = <out_dir>/checkpoints
    resume: str = "auto"  # auto: the newest complete checkpoint, if any | none: start fresh | a step_* directory
    resume_ignore: list[str] = field(default_factory=list)  # config keys allowed to differ from the checkpoint's
    # split (hybrid_rl/split/__init__.py): the last rollout_ranks ranks generate, samples <= max_staleness versions old
    placement: Literal["colocated", "split"] = "colocated"
    rollout_ranks: int = 1
    max_staleness: int = 0
    stale_samples: Literal["drop", "correct"] = "drop"
    # split/inflight.py: a rollout rank takes a new version where its batch ends (drain) or between decode steps,
    # decoding on over the cache the older weights wrote (continue), each token tagged with the version that sampled it
    inflight_update: Literal["drain", "continue"] = "drain"

    def __post_init__(self) -> None:
        check_choices(self, "trainer")
        check(
            self.rollout_ranks >= 1 and self.max_staleness >= 0,
            "trainer.rollout_ranks / trainer.max_staleness",
            f"must be >= 1 / >= 0 (0 = on-policy), got {self.rollout_ranks} / {self.max_staleness}",
        )
        check(self.total_steps > 0, "trainer.total_steps", "must be > 0")
        check(self.micro_batch_size > 0, "trainer.micro_batch_size", "must be > 0")
        check(
            self.max_tokens_per_micro_batch >= 0,
            "trainer.max_tokens_per_micro_batch",
            f"must be >= 0 (0 = off: micro_batch_size rows), got {self.max_tokens_per_micro_batch}",
        )
        check(
            self.dist_timeout_s is None or self.dist_timeout_s > 0,
            "trainer.dist_timeout_s",
            f"must be > 0 seconds, or null (derived from the rollout), got {self.dist_timeout_s}",
        )
        check(self.log_every >= 0, "trainer.log_every", f"must be >= 0 (0 = no console lines), got {self.log_every}")
        check(len(set(self.loggers)) == len(self.loggers), "trainer.loggers", f"names a logger twice: {self.loggers}")
        check(self.val_every >= 0, "trainer.val_every", f"must be >= 0 (0 = never), got {self.val_every}")
        check(self.val_n >= 0, "trainer.val_n", f"must be >= 0 (0 = greedy pass@1 only), got {self.val_n}")
        check(self.val_sample_rows >= 0, "trainer.val_sample_rows", f"must be >= 0, got {self.val_sample_rows}")
        check(self.log_rollouts >= 0, "trainer.log_rollouts", f"must be >= 0 (0 = off), got {self.log_rollouts}")
        check(
            self.save_every >= 0,
            "trainer.save_every",
            f"must be >= 0 (0 = no periodic checkpoints), got {self.save_every}",
        )
        check(self.keep_last >= 0, "trainer.keep_last", f"must be >= 0 (0 = keep all), got {self.keep_last}")
        check(bool(self.resume), "trainer.resume", "is empty; use auto, none or a checkpoint directory")

    @property
    def checkpoint_root(self) -> str:
        return self.checkpoint_dir or os.path.join(self.out_dir, "checkpoints")


# `env.*`: the environment of multi-turn episodes (issue 28). What the keys do is hybrid_rl/envs/ (the contract,
# the registry, the episode runner); `rollout.max_turns` and `rollout.max_episode_tokens` bound an episode. The
# checks that need the tokenizer, the model's context or the dataset's rows run at start-up in envs/setup.py.
@dataclass
class EnvConfig:
    """`env.*`. Neither name nor fn set: single-turn completions, as without this section."""

    name: str = ""  # a registered environment (built in: tiny_ask, gsm8k_calculator); "" = none
    fn: str = ""  # package.module:factory, imported at start-up; used instead of `name`
    timeout_s: float = 30.0  # a step running longer ends its episode (counted as episode/end_timeout)
    max_workers: int = 16  # environment steps run at once, on host threads

    @property
    def enabled(self) -> bool:
        return bool(self.name or self.fn)

    def __post_init__(self) -> None:
        check(not (self.name and self.fn), "env.fn", f"and env.name ({self.name!r}) are both set; give one of them")
        check(
            not self.fn or (":" in self.fn and all(self.fn.partition(":")[::2])),
            "env.fn",
            f"{self.fn!r} is not of the form package.module:factory",
        )
        check(self.timeout_s > 0, "env.timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        check(
            isinstance(self.max_workers, int) and self.max_workers >= 1,
            "env.max_workers",
            f"must be an integer >= 1, got {self.max_workers!r}",
        )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn episodes (issue 28); unset = single turn
    critic: CriticConfig = field(default_factory=CriticConfig)  # PPO's value model (algorithm.advantage=gae)

    @property
    def has_critic(self) -> bool:
        """PPO with a critic: the estimator's baseline is a learned value (algorithm.advantage=gae)."""
        from hybrid_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS

        return ADVANTAGE_ESTIMATORS[self.algorithm.advantage].critic

    def __post_init__(self) -> None:
        """Checks across sections."""
        if not self.has_critic:
            default = CriticConfig()
            changed = [f.name for f in fields(CriticConfig) if getattr(self.critic, f.name) != getattr(default, f.name)]
            check(
                not changed,
                f"critic.{changed[0]}" if changed else "critic",
                f"configures PPO's critic, which only algorithm.advantage=gae trains (got "
                f"{self.algorithm.advantage!r}); set algorithm.advantage=gae or drop the critic.* keys",
            )

        check(
            self.env.enabled or "env" not in self.reward.weights,
            "reward.weights",
            "has an 'env' weight but no environment is set; set env.name or env.fn",
        )
        if self.rollout.partial:
            self._check_partial()
        if self.rollout.partial_kv == "keep":
            self._check_partial_kv()
        if self.trainer.inflight_update == "continue":
            self._check_inflight()
        a, n = self.algorithm, self.rollout.n
        # An estimator without a group baseline (REINFORCE++ whitens over the whole batch) runs with one sample.
        from hybrid_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS

        group = ADVANTAGE_ESTIMATORS[a.advantage].group_baseline
        if group or a.dynamic_sampling:
            why = (
                "dynamic sampling keeps groups whose rewards differ"
                if not group
                else f"algorithm.advantage={a.advantage} takes its baseline from a prompt's group"
            )
            check(n >= 2, "rollout.n", f"needs at least 2 samples per prompt ({why}), got {n}")

    def _check_partial(self) -> None:
        """What rollout.partial cannot run with, each refused naming the key."""
        check(
            not self.env.enabled,
            "rollout.partial",
            "continues single-turn completions; a multi-turn episode (env.*) is not carried: set rollout.partial=false",
        )
        check(
            not self.algorithm.dynamic_sampling,
            "rollout.partial",
            "and algorithm.dynamic_sampling both decide which groups a step trains; set one of them false",
        )
        check(
            self.trainer.max_staleness >= 1,
            "trainer.max_staleness",
            "must be >= 1 with rollout.partial: a sample carried to the next step holds tokens one version old "
            "(0 would drop every carried sample); e.g. 2",
        )

    def _check_partial_kv(self) -> None:
        """What rollout.partial_kv=keep cannot run with, each refused naming the key."""
        key, r = "rollout.partial_kv", self.rollout
        check(r.partial, key, "'keep' keeps carried samples' caches: set rollout.partial=true, or partial_kv=recompute")
        check(
            r.engine == "native",
            key,
            f"'keep' is the native engine's (rollout.engine={r.engine} flushes its prefix cache when weights change); "
            "set rollout.engine=native or partial_kv=recompute",
        )

    def _check_inflight(self) -> None:
        """What trainer.inflight_update=continue cannot run with (split/inflight.py), each refused naming the key."""
        key, r = "trainer.inflight_update", self.rollout
        check(
            self.trainer.placement == "split",
            key,
            "'continue' updates a rollout rank's weights while it decodes; colocated, a rollout and a training never "
            "overlap, so there is nothing to update in flight: set trainer.placement=split or inflight_update=drain",
        )
        check(
            r.engine in ("native", "vllm"),
            key,
            f"'continue' needs an engine that takes weights between decode steps (native; vLLM's engine can, and the "
            f"split placement runs native only for now); rollout.engine={r.engine!r} generates a call whole: use "
            "inflight_update=drain",
        )
        check(
            r.tp_size == 1,
            key,
            f"'continue' needs one engine per rollout rank (rollout.tp_size=1, got {r.tp_size}): the ranks of a "
            "tensor-parallel engine would take a version at different steps",
        )
        check(
            not (r.engine == "vllm" and r.enable_prefix_caching),
            key,
            "'continue' with rollout.enable_prefix_caching=true: vLLM cannot drop its prefix cache while requests "
            "run; set rollout.enable_prefix_caching=false",
        )
        check(
            not (r.engine == "vllm" and self.model.lora.enabled),
            key,
            "'continue' with LoRA on vLLM: a new adapter applies only to requests added after it; use "
            "rollout.engine=native or inflight_update=drain",
        )
        check(
            not self.env.enabled,
            key,
            "'continue' tags the tokens of single generate calls; a multi-turn episode (env.*) joins several: "
            "use inflight_update=drain",
        )

    @property
    def process_group_timeout_s(self) -> int:
        """trainer.dist_timeout_s, or for null the longest rollout a step can run at DECODE_STEP_BOUND_S a decode step
        (rollout.max_new_tokens, times rollout.max_turns with an environment and algorithm.max_sampling_rounds with
        dynamic sampling), at least DIST_TIMEOUT_FLOOR_S: the other ranks wait that long for the slowest one's."""
        if self.trainer.dist_timeout_s is not None:
            return self.trainer.dist_timeout_s
        r, a = self.rollout, self.algorithm
        steps = r.max_new_tokens * (r.max_turns if self.env.enabled else 1)
        steps *= a.max_sampling_rounds if a.dynamic_sampling else 1
        return max(DIST_TIMEOUT_FLOOR_S, -(-steps * DECODE_STEP_BOUND_MS // 1000))


# After every section is defined: a field set from Python is checked by name and type (config/checks.py).
strict_sections(Config)
