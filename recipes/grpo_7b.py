"""GRPO on GSM8K with Qwen2.5-7B-Instruct on one 8-GPU node (settings and their sources: grpo_7b.yaml).

    torchrun --nproc_per_node=8 recipes/grpo_7b.py model.path=/models/Qwen2.5-7B-Instruct [key.sub=value ...]
    python recipes/grpo_7b.py --dry-run [--gpus 8] [--gpu-mem-gib 80] [key.sub=value ...]

--dry-run prints the resolved config and the memory plan, loads no weights, and exits
non-zero when a phase would not fit. A real start plans the same way for the GPUs it
runs on (or for --gpu-mem-gib) and refuses, printing the plan and the change to make,
when a phase does not fit. The rollout engine is SGLang when `sglang` is importable,
else the native engine (the log says which). On CPU, with a tiny model substituted:

    python -m hybrid_rl.models.tiny_text runs/tiny_text
    python recipes/grpo_7b.py model.path=runs/tiny_text trainer.device=cpu data.batch_size=4 rollout.n=4 \\
        rollout.max_new_tokens=32 data.max_prompt_tokens=384 data.val_size=8 data.val_batch_size=8 \\
        algorithm.mini_batch_size=0 trainer.micro_batch_size=16 trainer.total_steps=4 trainer.val_every=2
"""
import argparse
import importlib.util
import os
import sys

from omegaconf import OmegaConf

from hybrid_rl import Trainer, distributed, load_config
from hybrid_rl.memory_plan import GIB, PHASES, builtin_arch, load_arch, plan_memory, suggest_offload
from hybrid_rl.plan import format_plan

HERE = os.path.dirname(os.path.abspath(__file__))


def choose_engine(overrides: list[str]) -> tuple[list[str], str]:
    """SGLang where it is importable, else native (tp 1); an explicit rollout.engine= wins."""
    if any(o.startswith("rollout.engine=") for o in overrides):
        native_tp = "rollout.engine=native" in overrides and not any(o.startswith("rollout.tp_size=") for o in overrides)
        return ["rollout.tp_size=1"] if native_tp else [], "rollout engine: as given on the command line"
    if importlib.util.find_spec("sglang") is not None:
        return [], "rollout engine: sglang (importable here)"
    return ["rollout.engine=native", "rollout.tp_size=1"], (
        "rollout engine: native (sglang is not importable here; pip install 'hybrid_rl[gpu]' on a GPU machine)")


def memory_plan(cfg, n_gpus: int, gpu_mem_gib: float):
    """The planner's bill for this config: (plan, suggestion); no weights are read."""
    path = cfg.model.path
    has_config = os.path.isfile(os.path.join(path, "config.json"))
    arch = load_arch(path) if has_config else builtin_arch(os.path.basename(os.path.normpath(path)))
    has_ref = cfg.algorithm.needs_ref_model
    off = cfg.offload
    flags = {"optimizer": off.optimizer, "ref": off.ref or not has_ref, "params": off.params}
    ro = cfg.rollout
    tp = ro.tp_size if ro.engine in ("sglang", "vllm") else 1
    prompt_tokens = cfg.data.max_prompt_tokens or 1024
    # The native engine decodes what fits in a batch: its prefill, sampler and graph pools are billed too.
    native = dict(native_prompt_tokens=prompt_tokens, native_top_p=cfg.rollout.top_p < 1.0,
                  native_samples_per_prompt=cfg.rollout.n) if cfg.rollout.engine == "native" else {}
    kw = dict(tp_size=tp, gpu_mem_gib=gpu_mem_gib, train_micro_batch=cfg.trainer.micro_batch_size,
              gradient_checkpointing=cfg.model.gradient_checkpointing, engine=ro.engine, **native)
    if ro.engine == "vllm":  # the KV cache vLLM allocates at start, as rollout/vllm_setup.py sizes it
        kw.update(kv_cache_budget=ro.kv_cache_bytes, mem_fraction=ro.mem_fraction)
    dtype = "fp32" if cfg.model.dtype == "float32" else "bf16"
    sequences = cfg.data.batch_size * cfg.rollout.n
    context = prompt_tokens + cfg.rollout.max_new_tokens
    suggestion = suggest_offload(arch, n_gpus, dtype, sequences, context, flags, **kw)
    if off.auto:  # the trainer takes the planner's advice itself
        flags = suggestion["offload"]
    return plan_memory(arch, n_gpus, dtype, sequences, context, flags, **kw), suggestion


def verdict(plan, suggestion) -> str:
    """'' when every phase fits, else the refusal: what does not fit and the change to make."""
    if plan.fits_all:
        return ""
    short = ", ".join(f"{p} (short by {plan.shortfall[p] / 1e9:.2f} GB per GPU)" for p in PHASES if not plan.fits[p])
    change = (" ".join(f"offload.{f}=true" for f in suggestion["added"]) if suggestion["fits"]
              else suggestion["message"])
    return f"refusing to start: {short} does not fit; suggested change: {change}"


@distributed.report_failures
def main(argv: list[str]) -> dict:
    # 1. Config: the YAML next to this file, the engine this machine can run, then the command line.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the config and memory plan; load nothing")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: the ranks, 8 on --dry-run)")
    parser.add_argument("--gpu-mem-gib", type=float, default=None, help="GPU memory to plan for (default: measured, 80)")
    args, overrides = parser.parse_known_args(argv)
    engine_overrides, engine_note = choose_engine(overrides)
    cfg = load_config(os.path.join(HERE, "grpo_7b.yaml"), engine_overrides + overrides)

    # 2. Memory plan: refuse to start when a phase does not fit.
    if args.dry_run:
        print(engine_note)
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        plan, suggestion = memory_plan(cfg, args.gpus or 8, args.gpu_mem_gib or 80.0)
        print(format_plan(plan, suggestion))
        refusal = verdict(plan, suggestion)
        if refusal:
            sys.exit(refusal)
        return {"dry_run": True, "fits": True, "phase_totals": plan.phase_totals}
    device = distributed.init(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    gpu_mem = args.gpu_mem_gib
    if gpu_mem is None and device.type == "cuda":
        import torch

        gpu_mem = torch.cuda.get_device_properties(device).total_memory / GIB
    if distributed.is_main():
        print(engine_note)
    if gpu_mem is not None:  # on CPU the device is host memory: nothing to plan for unless asked
        plan, suggestion = memory_plan(cfg, args.gpus or distributed.world_size(), gpu_mem)
        refusal = verdict(plan, suggestion)
        if distributed.is_main():
            print(format_plan(plan, suggestion))
        if refusal:
            distributed.shutdown()
            sys.exit(refusal)

    # 3. Train (validation and logging run inside fit), then save the policy as a HF directory.
    trainer = Trainer(cfg)
    history = trainer.fit()
    trainer.save_pretrained(os.path.join(cfg.trainer.out_dir, "final_model"))
    trainer.close()

    # 4. Summary: training reward over the first and last 10% of steps, validation first and last.
    k = max(1, len(history) // 10)
    vals = [h["val/pass@1"] for h in history if "val/pass@1" in h]
    summary = {"steps": len(history), "reward_first10": sum(h["reward/mean"] for h in history[:k]) / k,
               "reward_last10": sum(h["reward/mean"] for h in history[-k:]) / k,
               "val_pass@1_last": vals[-1] if vals else None, "out_dir": cfg.trainer.out_dir}
    if distributed.is_main():
        print(f"reward: first 10% {summary['reward_first10']:.3f} -> last 10% {summary['reward_last10']:.3f} "
              f"over {len(history)} steps; val pass@1 (greedy) last: {summary['val_pass@1_last']}")
    distributed.shutdown()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
