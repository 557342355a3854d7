"""One memory plan from a run's config: the recipe's gate and the trainer's `offload.auto` plan here.

`plan_from_config` turns a `Config` into the planner's arguments (plan.memory.plan_memory) once:
the policy and reward model architectures, dtype, batch, context, engine and its KV settings, the
training micro-batch and the offload flags. `recipes/grpo_7b.py` (its dry run and its start gate)
and `switch/advice.decide_offload` (the trainer's offload.auto) both call it, so a dry run bills
what a run does. What they pass in is the one thing a dry run may not know exactly: the prompt
length (`prompt_tokens_for_plan` measures it as the trainer does when it can, and says how).

Torch-free: the dry run imports it without building a model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from hybrid_rl.plan.arch import lora_param_count
from hybrid_rl.plan.fixes import Fix, Setting, search_fixes
from hybrid_rl.plan.memory import OFFLOAD_FLAGS, MemoryPlan, ModelArch, builtin_arch, plan_memory, suggest_offload

__all__ = ["PROMPT_SAMPLE", "PromptTokens", "config_arch", "config_fixes", "plan_from_config", "prompt_tokens_for_plan"]

# The trainer plans with the longest of its first PROMPT_SAMPLE training prompts (after the long ones are
# dropped); the dry run measures the same rows.
PROMPT_SAMPLE = 256
_GUESS = 1024  # prompt tokens when neither the data nor data.max_prompt_tokens says


def config_arch(path: str, key: str) -> ModelArch:
    """The architecture of the model at `path` (config key `key`): its config.json when the directory has one
    (what a run reads), else a built-in architecture named like the directory (a dry run without the weights)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelArch.from_hf_config(os.path.join(path, "config.json"))
    try:
        return builtin_arch(os.path.basename(os.path.normpath(path)))
    except ValueError as err:
        raise ValueError(
            f"config key '{key}': {path!r} has no config.json, and {err}; point {key} at a local "
            "Hugging Face directory (its config.json is enough to plan)"
        ) from None


def plan_context(cfg, prompt_tokens: int) -> tuple[int, int]:
    """(context, the longest prompt of one engine call) billed per sequence. Single turns: the prompt plus
    rollout.max_new_tokens. With an environment (env.*): rollout.max_episode_tokens, the vLLM engine's
    max_model_len and the longest episode the trainer scores; a later turn's call carries the episode so far,
    billed as the longest prompt that still leaves rollout.max_new_tokens in that context."""
    ro = cfg.rollout
    if not cfg.env.enabled:
        return prompt_tokens + ro.max_new_tokens, prompt_tokens
    context = max(ro.max_episode_tokens, prompt_tokens + 1)
    return context, max(prompt_tokens, context - ro.max_new_tokens)


def plan_from_config(
    cfg, n_gpus: int, gpu_mem_gib: float, *, prompt_tokens: int, mixed_precision: Optional[bool] = None
) -> tuple[MemoryPlan, dict[str, Any]]:
    """(plan, suggestion) for `cfg` on `n_gpus` GPUs of `gpu_mem_gib` GiB each.

    prompt_tokens: the longest prompt in tokens (context: plan_context, prompt_tokens + rollout.max_new_tokens
    or with an environment rollout.max_episode_tokens; the native
    engine's prefill is billed for it). mixed_precision: bf16 weights with fp32 masters (None: as on CUDA,
    model.dtype auto or bfloat16). With offload.auto the plan uses the suggested flags (roles the run lacks
    count as offloaded), as the trainer does; else the configured flags, and the suggestion names the smallest
    change that makes every phase fit (plan.memory.suggest_offload).
    """
    arch, dtype, sequences, context, flags, kw = _plan_args(cfg, n_gpus, gpu_mem_gib, prompt_tokens, mixed_precision)
    if cfg.offload.auto:  # flags: the roles the run lacks, as "offloaded" (they hold nothing)
        suggestion = suggest_offload(arch, n_gpus, dtype, sequences, context, flags, **kw)
        flags = suggestion["offload"]
    else:
        flags = {**flags, **{f: flags[f] or _configured(cfg, f) for f in OFFLOAD_FLAGS}}
        suggestion = suggest_offload(arch, n_gpus, dtype, sequences, context, flags, **kw)
    return plan_memory(arch, n_gpus, dtype, sequences, context, flags, **kw), suggestion


def _configured(cfg, flag: str) -> bool:
    """The configured offload flag: offload.* for the policy's roles, critic.offload_* for PPO's critic."""
    critic = {"critic": "offload_params", "critic_optimizer": "offload_optimizer"}
    return getattr(cfg.critic, critic[flag]) if flag in critic else getattr(cfg.offload, flag)


def _plan_args(cfg, n_gpus: int, gpu_mem_gib: float, prompt_tokens: int, mixed_precision: Optional[bool]):
    """(arch, dtype, sequences, context, absent-role flags, plan_memory keywords) for `cfg`."""
    lora = cfg.model.lora  # LoRA: adapter-only learner state, and the reference is the base (no copy of its own)
    has_ref, has_rm = cfg.algorithm.needs_ref_model and not lora.enabled, bool(cfg.reward.model_path)
    arch = config_arch(cfg.model.path, "model.path")
    reward_arch = config_arch(cfg.reward.model_path, "reward.model_path") if has_rm else None
    if mixed_precision is None:
        mixed_precision = cfg.model.dtype in ("auto", "bfloat16")
    ro = cfg.rollout
    kw: dict[str, Any] = dict(
        tp_size=ro.tp_size,
        gpu_mem_gib=gpu_mem_gib,
        reward_arch=reward_arch,
        train_micro_batch=cfg.trainer.micro_batch_size,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        engine=ro.engine,
        lora_params=lora_param_count(arch, lora.rank, lora.target_modules) if lora.enabled else 0,
        # PPO's critic (critic.path, default the policy's directory): a second learner
        critic_arch=config_arch(cfg.critic.path or cfg.model.path, "critic.path") if cfg.has_critic else None,
    )
    if ro.engine == "native":  # it decodes what fits: its prefill, sampler and graph pools are billed too
        kw.update(
            native_prompt_tokens=plan_context(cfg, prompt_tokens)[1],
            native_top_p=ro.top_p < 1.0,
            native_samples_per_prompt=ro.n,
        )
    if ro.engine == "vllm":  # the KV cache vLLM allocates at start, as rollout/vllm/setup.py sizes it
        kw.update(kv_cache_budget=ro.kv_cache_bytes, mem_fraction=ro.mem_fraction)
    if ro.engine == "sglang":  # the KV pool SGLang sizes at start from mem_fraction_static (plan/memory.py)
        kw.update(mem_fraction=ro.mem_fraction)
    dtype = "bf16" if mixed_precision else "fp32"
    absent = {"optimizer": False, "params": False, "ref": not has_ref, "reward_model": not has_rm}
    absent.update(critic=not cfg.has_critic, critic_optimizer=not cfg.has_critic)
    return arch, dtype, cfg.data.batch_size * ro.n, plan_context(cfg, prompt_tokens)[0], absent, kw


def config_fixes(
    cfg, n_gpus: int, gpu_mem_gib: float, *, prompt_tokens: int, mixed_precision: Optional[bool] = None
) -> list[Fix]:
    """The ranked config changes that make a plan that does not fit fit (plan.fixes.search_fixes), named as
    command-line overrides; [] when it fits."""

    def with_setting(s: Setting):
        r = dataclasses.replace
        return r(
            cfg,
            data=r(cfg.data, batch_size=s.prompts),
            rollout=r(cfg.rollout, n=s.n, tp_size=s.tp_size),
            model=r(cfg.model, lora=r(cfg.model.lora, rank=s.lora_rank)),
            offload=r(cfg.offload, auto=False),
        )

    def plan_fn(s: Setting) -> MemoryPlan:
        arch, dtype, seqs, context, absent, kw = _plan_args(
            with_setting(s), s.n_gpus, gpu_mem_gib, prompt_tokens, mixed_precision
        )
        flags = {f: s.offload.get(f, False) or absent[f] for f in OFFLOAD_FLAGS}
        return plan_memory(arch, s.n_gpus, dtype, seqs, context, flags, **kw)

    plan, suggestion = plan_from_config(
        cfg, n_gpus, gpu_mem_gib, prompt_tokens=prompt_tokens, mixed_precision=mixed_precision
    )
    start = Setting(
        n_gpus, cfg.data.batch_size, cfg.rollout.n, cfg.rollout.tp_size, cfg.model.lora.rank, dict(plan.offload)
    )
    arch = config_arch(cfg.model.path, "model.path")
    return search_fixes(
        plan_fn,
        start,
        lambda knob, old, new: _override(cfg, knob, old, new),
        tp_ok=cfg.rollout.engine != "native",
        max_tp=arch.kv_heads or 8,
    )


def _override(cfg, knob: str, old: Setting, new: Setting) -> str:
    """A fix as the overrides to type (offload: only the flags it adds)."""
    if knob == "offload":
        return " ".join(f"offload.{f}=true" for f in OFFLOAD_FLAGS if new.offload.get(f) and not old.offload.get(f))
    if knob == "batch":
        seqs, mb = new.prompts * new.n, cfg.algorithm.mini_batch_size
        return f"data.batch_size={new.prompts}" + (" algorithm.mini_batch_size=0" if mb and seqs % mb else "")
    if knob == "n":
        seqs, mb = new.prompts * new.n, cfg.algorithm.mini_batch_size
        return f"rollout.n={new.n}" + (" algorithm.mini_batch_size=0" if mb and (seqs % mb or mb % new.n) else "")
    if knob == "gpus":
        return f"--gpus {new.n_gpus} (torchrun --nproc_per_node={min(new.n_gpus, 8)}" + (
            f" --nnodes={new.n_gpus // 8})" if new.n_gpus > 8 else ")"
        )
    return f"rollout.tp_size={new.tp_size}" if knob == "tp" else f"model.lora.rank={new.lora_rank}"


@dataclass(frozen=True)
class PromptTokens:
    """The prompt length a plan bills, and where it came from (the dry run prints it)."""

    tokens: int
    source: str


def prompt_tokens_for_plan(cfg) -> PromptTokens:
    """The longest prompt as the trainer measures it when the tokenizer and the dataset are local (the longest of
    the first PROMPT_SAMPLE training prompts, chat template applied, those over the limit dropped); else
    data.max_prompt_tokens; else a guess of 1024 tokens, said to be one."""
    why = _not_local(cfg)
    if not why:
        try:
            return _measured(cfg)
        except (ValueError, OSError) as err:  # the trainer raises the same at its start; the plan goes on without
            why = f"the prompts could not be measured: {err}"
    if cfg.data.max_prompt_tokens:
        return PromptTokens(cfg.data.max_prompt_tokens, f"data.max_prompt_tokens ({why})")
    return PromptTokens(_GUESS, f"a guess ({why}, and data.max_prompt_tokens is 0): set data.max_prompt_tokens")


def _not_local(cfg) -> str:
    """'' when the prompts can be measured here without a download, else why not."""
    from hybrid_rl.data import gsm8k

    path, d = cfg.model.path, cfg.data
    if not (
        os.path.isfile(os.path.join(path, "config.json"))
        and any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    ):
        return f"no tokenizer at model.path {path!r}"
    local_gsm8k = any(
        os.path.isfile(os.path.join(p, "train" + ext)) for p in gsm8k.default_dirs() for ext in (".jsonl", ".parquet")
    )
    if d.task == "gsm8k" and not (d.path or local_gsm8k):
        return "GSM8K is not local (a run would download it)"
    if d.task in ("jsonl", "parquet") and not os.path.isfile(d.path):
        return f"data.path {d.path!r} is not a file here"
    return ""


def _measured(cfg) -> PromptTokens:
    import json

    from hybrid_rl.data.chat import PromptEncoder, prompt_limit, use_chat_template
    from hybrid_rl.data.prompts import load_datasets
    from hybrid_rl.models.loading import load_tokenizer

    path = cfg.model.path
    tok = load_tokenizer(path)
    encode = PromptEncoder(tok, use_chat_template(tok, cfg.data.chat_template, path), path, cfg.data.system_prompt)
    with open(os.path.join(path, "config.json")) as f:
        context = json.load(f).get("max_position_embeddings")
    limit = prompt_limit(cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens, context)[0]
    data = load_datasets(cfg.data)
    kept: list[int] = []
    for row in data.train:  # the rows the trainer keeps, in order, until it has its sample
        n = len(encode(row))
        if not limit or n <= limit:
            kept.append(n)
            if len(kept) == PROMPT_SAMPLE:
                break
    if not kept:
        raise ValueError(
            f"every training prompt of {data.train_source} is longer than {limit} tokens; raise data.max_prompt_tokens"
        )
    return PromptTokens(
        max(kept),
        f"the longest of the first {len(kept)} training prompts of {data.train_source}, tokenized as the trainer does",
    )
