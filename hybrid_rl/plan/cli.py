"""Memory-planner CLI: ``python -m hybrid_rl.plan``.

Examples::

    python -m hybrid_rl.plan --model Qwen2.5-7B --gpus 8 --batch 256 --context 4096 \\
        --gpu-mem-gib 80 --offload optimizer,ref
    python -m hybrid_rl.plan --model path/to/config.json --gpus 8 --batch 64 --context 8192
    python -m hybrid_rl.plan --params 70e9 --gpus 8 --batch 64 --context 4096 \\
        [--layers 80 --kv-heads 8 --head-dim 128]
    python -m hybrid_rl.plan --model Qwen2.5-7B --reward-model Qwen2.5-7B --gpus 8 --batch 256 --context 4096
        # a reward model (built-in name, or a *ForSequenceClassification config.json: score head, no lm_head)
        # adds the REWARD stage's column
    python -m hybrid_rl.plan --model Qwen2.5-7B --gpus 8 --batch 5120 --context 1536 --native-prompt-tokens 512
        # the native engine: rows decoded at once from what ROLLOUT leaves free, prefill / sampling billed
    python -m hybrid_rl.plan --from-run runs/x/metrics.jsonl --run-gpus 2 --gpus 8
        # step time of colocated and split (each R, k = 0,1,2) from a run's measured rates (plan/placement.py)

Prints a table of roles x phases (GB = 1e9 bytes per GPU, and totals over all
GPUs), whether each phase fits, a suggested offload line, and a JSON object as
the last line.  Accounting rules, and the per-GPU margin no phase may use: see
``hybrid_rl.plan.memory``. When a phase does not fit, the ranked changes that would make it
fit, each with its plan line (``hybrid_rl.plan.fixes``).

GPU memory is --gpu-mem-gib, in GiB (2**30 bytes), the unit GPUs are sold in and
recipes/grpo_7b.py's flag too. The old --gpu-mem-gb read GiB under a GB name; it is refused
with the new name rather than kept as an alias, so that no command line goes on saying GB
for GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

from hybrid_rl.plan import placement
from hybrid_rl.plan.arch import lora_param_count
from hybrid_rl.plan.fixes import Setting, search_fixes
from hybrid_rl.plan.memory import (
    BUILTIN_ARCHS,
    DTYPE_BYTES,
    GB,
    OFFLOAD_FLAGS,
    MemoryPlan,
    ModelArch,
    load_arch,
    plan_memory,
    suggest_offload,
)
from hybrid_rl.plan.report import format_plan


def _pos_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}")
    return v


def _nonneg_int(s: str) -> int:
    return 0 if s.strip() == "0" else _pos_int(s)


def _pos_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}")
    return v


def _param_count(s: str) -> int:
    v = _pos_float(s)
    if v != int(v):
        raise argparse.ArgumentTypeError(f"parameter count must be a whole number, got {s!r}")
    return int(v)


def _offload(s: str) -> dict[str, bool]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    if names in ([], ["none"]):
        return {}
    if names == ["all"]:
        return {f: True for f in OFFLOAD_FLAGS}
    bad = [x for x in names if x not in OFFLOAD_FLAGS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown offload flag(s) {', '.join(bad)}; choose from {', '.join(OFFLOAD_FLAGS)}, 'all' or 'none'"
        )
    return {x: True for x in names}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hybrid_rl.plan",
        description="Per-GPU memory bill per role and phase for colocated GRPO training.",
        epilog="built-in models: " + ", ".join(BUILTIN_ARCHS),
    )
    p.add_argument("--model", help="built-in name, path to a HF config.json, or a directory containing one")
    p.add_argument(
        "--params",
        type=_param_count,
        help="parameter count (e.g. 70e9); overrides the count of --model if both are given",
    )
    p.add_argument("--layers", type=_pos_int, help="layers (for the KV cache with --params)")
    p.add_argument("--kv-heads", type=_pos_int, help="KV heads (for the KV cache with --params)")
    p.add_argument("--head-dim", type=_pos_int, help="head dim (for the KV cache with --params)")
    p.add_argument("--gpus", type=_pos_int, required=True, help="number of GPUs (FSDP shards over all)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    p.add_argument(
        "--batch", type=_pos_int, required=True, help="sequences resident in the KV cache at once (all GPUs)"
    )
    p.add_argument("--context", type=_pos_int, required=True, help="prompt + response tokens per sequence")
    p.add_argument("--gpu-mem-gib", type=_pos_float, default=80.0, help="GPU memory in GiB (default 80)")
    p.add_argument("--gpu-mem-gb", dest="old_gpu_mem_gb", help=argparse.SUPPRESS)
    p.add_argument(
        "--lora-rank",
        type=_nonneg_int,
        default=0,
        help="LoRA rank on every linear layer (model.lora.rank; 0: the whole policy trains)",
    )
    p.add_argument("--tp", type=_pos_int, default=1, help="rollout tensor-parallel size (default 1)")
    p.add_argument(
        "--offload", type=_offload, default={}, help=f"comma list of {','.join(OFFLOAD_FLAGS)} (or 'all' / 'none')"
    )
    p.add_argument(
        "--critic",
        action="store_true",
        help="PPO with a critic (algorithm.advantage=gae): a second learner of the policy's architecture (16N more)",
    )
    p.add_argument("--reward-model", help="reward model: built-in name or HF config path")
    p.add_argument(
        "--reward-params", type=_param_count, help="reward model parameter count (instead of --reward-model)"
    )
    p.add_argument(
        "--train-micro-batch",
        type=_nonneg_int,
        default=0,
        help="sequences per GPU per training micro-step; adds an activation ESTIMATE to train (0: off)",
    )
    p.add_argument(
        "--engine",
        choices=["native", "sglang", "vllm"],
        default="sglang",
        help="rollout engine with its own weight copy (sglang, vllm) or the policy's (native, with "
        "--native-prompt-tokens for its decode batch); default sglang",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=_pos_float,
        default=None,
        help="vllm: the KV cache per GPU in GB (rollout.kv_cache_bytes / 1e9); default: from --mem-fraction, "
        "else one batch of --context tokens",
    )
    p.add_argument(
        "--mem-fraction",
        type=_pos_float,
        default=None,
        help="rollout.mem_fraction: sglang's mem_fraction_static (its KV pool is sized from it), or vllm's "
        "gpu_memory_utilization when --kv-cache-gb is not given",
    )
    p.add_argument(
        "--no-gradient-checkpointing",
        dest="gradient_checkpointing",
        action="store_false",
        help="estimate activations without gradient checkpointing (model.gradient_checkpointing=false)",
    )
    p.add_argument(
        "--native-prompt-tokens",
        type=_nonneg_int,
        default=0,
        help="plan the native engine's rollout for prompts of this many tokens (0: off): its decode batch "
        "is capped by the free memory, and its prefill, sampling and graph pools are billed",
    )
    p.add_argument(
        "--native-sampler",
        choices=["top_p", "plain"],
        default="top_p",
        help="the native engine's sampler (top_p sorts the vocabulary: more temporaries)",
    )
    p.add_argument(
        "--samples-per-prompt",
        type=_pos_int,
        default=1,
        help="native engine: samples per prompt, which share one prefill (rollout.n)",
    )
    return p


def _arch_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[ModelArch, ModelArch | None]:
    if not args.model and args.params is None:
        parser.error("give --model (name or config.json) or --params")
    if args.model:
        arch = load_arch(args.model)
        if args.params is not None:
            arch = dataclasses.replace(arch, num_params=args.params)
    else:
        arch = ModelArch(name=f"{args.params / 1e9:g}B params", num_params=args.params)
    kv = {"num_hidden_layers": args.layers, "num_key_value_heads": args.kv_heads, "head_dim_": args.head_dim}
    kv = {k: v for k, v in kv.items() if v is not None}
    if kv:
        if "num_key_value_heads" in kv and not arch.num_attention_heads:
            kv["num_attention_heads"] = kv["num_key_value_heads"]
        arch = dataclasses.replace(arch, **kv)
    if args.reward_model and args.reward_params is not None:
        parser.error("give either --reward-model or --reward-params, not both")
    rm = load_arch(args.reward_model) if args.reward_model else None
    if args.reward_params is not None:
        rm = ModelArch(name="reward model", num_params=args.reward_params)
    return arch, rm


def _engine_kw(args) -> dict:
    """The planner's engine arguments: --native-prompt-tokens implies the native engine."""
    engine = "native" if args.native_prompt_tokens else args.engine
    if engine != "vllm" and args.kv_cache_gb is not None:
        raise ValueError("--kv-cache-gb sizes vLLM's KV cache: add --engine vllm")
    if engine == "native" and args.mem_fraction is not None:
        raise ValueError("--mem-fraction sizes SGLang's or vLLM's KV cache; the native engine decodes what fits")
    kv = None if args.kv_cache_gb is None else int(args.kv_cache_gb * GB)
    return (
        dict(engine=engine, kv_cache_budget=kv, mem_fraction=args.mem_fraction)
        if engine == "vllm"
        else dict(engine=engine, mem_fraction=args.mem_fraction)
        if engine == "sglang"
        else dict(engine=engine)
    )


_CLI_NAMES = {
    "batch": lambda s: f"--batch {s.prompts}",
    "tp": lambda s: f"--tp {s.tp_size}",
    "gpus": lambda s: f"--gpus {s.n_gpus}",
    "lora": lambda s: f"--lora-rank {s.lora_rank}",
}


def _cli_fixes(args, arch: ModelArch, kw: dict) -> list:
    """The ranked changes to the command line that make every phase fit (plan/fixes.py)."""

    def plan_fn(s: Setting) -> MemoryPlan:
        lora = lora_param_count(arch, s.lora_rank) if s.lora_rank else 0
        return plan_memory(
            arch,
            s.n_gpus,
            args.dtype,
            s.prompts,
            args.context,
            s.offload,
            **{**kw, "tp_size": s.tp_size, "lora_params": lora},
        )

    def namer(knob: str, old: Setting, new: Setting) -> str:
        if knob == "offload":
            return "--offload " + ",".join(f for f in OFFLOAD_FLAGS if new.offload.get(f))
        return _CLI_NAMES[knob](new)

    start = Setting(args.gpus, args.batch, 1, args.tp, args.lora_rank, dict(args.offload))
    return search_fixes(plan_fn, start, namer, tp_ok=kw["engine"] != "native", n_ok=False, max_tp=arch.kv_heads or 8)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if placement.wants_rates(argv):  # --from-run / --placement: the placements' step times, not the memory bill
        return placement.main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.old_gpu_mem_gb is not None:
        parser.error(f"--gpu-mem-gb is now --gpu-mem-gib (it always meant GiB): --gpu-mem-gib {args.old_gpu_mem_gb}")
    try:
        arch, rm = _arch_from_args(args, parser)
        lora = lora_param_count(arch, args.lora_rank) if args.lora_rank else 0
        kw = dict(
            tp_size=args.tp,
            reward_arch=rm,
            critic_arch=arch if args.critic else None,
            gpu_mem_gib=args.gpu_mem_gib,
            lora_params=lora,
            train_micro_batch=args.train_micro_batch,
            native_prompt_tokens=args.native_prompt_tokens,
            gradient_checkpointing=args.gradient_checkpointing,
            **_engine_kw(args),
            native_top_p=args.native_sampler == "top_p",
            native_samples_per_prompt=args.samples_per_prompt,
        )
        plan = plan_memory(arch, args.gpus, args.dtype, args.batch, args.context, args.offload, **kw)
        suggestion = suggest_offload(arch, args.gpus, args.dtype, args.batch, args.context, args.offload, **kw)
        fixes = _cli_fixes(args, arch, kw) if not plan.fits_all else []
    except ValueError as e:
        parser.error(str(e))
    print(format_plan(plan, suggestion, fixes))
    print(
        json.dumps(
            {
                **plan.to_dict(),
                "suggestion": suggestion,
                "fixes": [{"knob": f.knob, "change": f.change} for f in fixes],
            },
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
