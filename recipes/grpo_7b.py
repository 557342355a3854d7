"""GRPO on GSM8K with Qwen2.5-7B-Instruct on one 8-GPU node (settings and their sources: grpo_7b.yaml);
PPO with a critic, verl's PPO settings, with --config recipes/ppo_7b.yaml.

    torchrun --nproc_per_node=8 recipes/grpo_7b.py model.path=/models/Qwen2.5-7B-Instruct [key.sub=value ...]
    python recipes/grpo_7b.py --dry-run [--gpus 8] [--gpu-mem-gib 80] [key.sub=value ...]
    python recipes/grpo_7b.py --dry-run env.name=gsm8k_calculator   (multi-turn, with a calculator tool)
    python recipes/grpo_7b.py --config recipes/ppo_7b.yaml --dry-run [--gpus 1]   (PPO: actor, critic, ...)

--dry-run prints the resolved config and the memory plan, loads no weights, and exits
non-zero when a phase would not fit, after the ranked changes that would make it fit
(hybrid_rl/plan/fixes.py: offload, a smaller data.batch_size or rollout.n, rollout.tp_size,
more GPUs, LoRA), each with its plan line. A phase fits only within the GPU less a margin for
the CUDA context, NCCL and fragmentation (hybrid_rl/plan/memory.py). It plans as the trainer's offload.auto does
(hybrid_rl/plan/from_config.py): the reward model's config.json, and the prompt lengths measured
on the dataset when the tokenizer and data are local (else data.max_prompt_tokens); it
prints which. A real start plans the same way for the GPUs it
runs on (or for --gpu-mem-gib) and refuses, printing the plan and the change to make,
when a phase does not fit. The rollout engine is SGLang when `sglang` is importable,
else the native engine (the log says which). On CPU, with a tiny model substituted:

    python -m hybrid_rl.models.tiny_text runs/tiny_text
    python recipes/grpo_7b.py model.path=runs/tiny_text trainer.device=cpu data.batch_size=4 rollout.n=4 \\
        rollout.max_new_tokens=32 data.max_prompt_tokens=384 data.val_size=8 data.val_batch_size=8 \\
        algorithm.mini_batch_size=0 trainer.micro_batch_size=16 trainer.total_steps=4 trainer.val_every=2
"""

import importlib.util
import os
import sys

from omegaconf import OmegaConf

from hybrid_rl import Trainer, load_config
from hybrid_rl.config.checks import RecipeParser, command_line
from hybrid_rl.observability.metrics import reward_summary, run_history
from hybrid_rl.plan.from_config import PromptTokens, config_fixes, plan_from_config, prompt_tokens_for_plan
from hybrid_rl.plan.memory import GIB, PHASES
from hybrid_rl.plan.report import format_plan
from hybrid_rl.runtime import distributed

HERE = os.path.dirname(os.path.abspath(__file__))


def choose_engine(overrides: list[str]) -> tuple[list[str], str]:
    """SGLang where it is importable, else native (tp 1); an explicit rollout.engine= wins."""
    if any(o.startswith("rollout.engine=") for o in overrides):
        native_tp = "rollout.engine=native" in overrides and not any(
            o.startswith("rollout.tp_size=") for o in overrides
        )
        return ["rollout.tp_size=1"] if native_tp else [], "rollout engine: as given on the command line"
    if importlib.util.find_spec("sglang") is not None:
        return [], "rollout engine: sglang (importable here)"
    return ["rollout.engine=native", "rollout.tp_size=1"], (
        "rollout engine: native (sglang is not importable here; pip install 'hybrid_rl[gpu]' on a GPU machine)"
    )


# GSM8K with a calculator tool (env.name=gsm8k_calculator, hybrid_rl/envs/gsm8k_calc.py): the model may call
# `calculator` in Qwen2.5's <tool_call> format (schemas in the system prompt; its template renders tool
# results) before its '####' answer, scored by the same gsm8k verifier as a plain run. An episode gets 4 turns
# and 2048 tokens: the 512-token prompt, 1024 for the answering turn, the rest for short calls and results.
ENV_DEFAULTS = ["rollout.max_turns=4", "rollout.max_episode_tokens=2048"]


def env_overrides(overrides: list[str]) -> list[str]:
    """With an environment (env.name= or env.fn=), the episode bounds above; the command line's own win."""
    if not any(o.split("=")[0] in ("env.name", "env.fn") and o.split("=", 1)[1] for o in overrides if "=" in o):
        return []
    given = {o.split("=")[0] for o in overrides}
    return [d for d in ENV_DEFAULTS if d.split("=")[0] not in given]


def memory_plan(cfg, n_gpus: int, gpu_mem_gib: float, prompts: PromptTokens | None = None):
    """The planner's bill for this config, as the trainer's offload.auto plans it (hybrid_rl/plan/from_config.py):
    (plan, suggestion, fixes: the ranked changes that fit, [] when it fits). No weights are read; prompts:
    the prompt length to bill (default: measured if local)."""
    prompts = prompts or prompt_tokens_for_plan(cfg)
    plan, suggestion = plan_from_config(cfg, n_gpus, gpu_mem_gib, prompt_tokens=prompts.tokens)
    fixes = [] if plan.fits_all else config_fixes(cfg, n_gpus, gpu_mem_gib, prompt_tokens=prompts.tokens)
    return plan, suggestion, fixes


def plan_inputs(cfg, prompts: PromptTokens) -> str:
    """What the plan billed that a run measures: the prompt length and the reward model."""
    rm = (
        f"reward.model_path={cfg.reward.model_path}"
        if cfg.reward.model_path
        else f"none (rule reward {cfg.reward.name})"
    )
    return f"planned for prompts of {prompts.tokens} tokens: {prompts.source}\nreward model billed: {rm}"


def verdict(plan, fixes) -> str:
    """'' when every phase fits, else the refusal: what does not fit and the first ranked change to make."""
    if plan.fits_all:
        return ""
    short = ", ".join(f"{p} (short by {plan.shortfall[p] / 1e9:.2f} GB per GPU)" for p in PHASES if not plan.fits[p])
    change = fixes[0].change if fixes else "none of the changes above fits alone: combine them"
    return f"refusing to start: {short} does not fit; suggested change: {change}"


def parse_args(argv: list[str]):
    """(the recipe's flags, the key=value overrides)."""
    parser = RecipeParser(__doc__, "recipes/grpo_7b.yaml")
    parser.add_argument("--dry-run", action="store_true", help="print the config and memory plan; load nothing")
    parser.add_argument(
        "--config",
        default=os.path.join(HERE, "grpo_7b.yaml"),
        help="the recipe's YAML (default recipes/grpo_7b.yaml; recipes/ppo_7b.yaml is PPO with a critic)",
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: the ranks, 8 on --dry-run)")
    parser.add_argument(
        "--gpu-mem-gib",
        type=float,
        default=None,
        help="GPU memory in GiB to plan for (default: measured, 80 on --dry-run); as python -m hybrid_rl.plan",
    )
    if any(a.split("=")[0] == "--gpu-mem-gb" for a in argv):
        parser.error("--gpu-mem-gb is --gpu-mem-gib here and in python -m hybrid_rl.plan (the value is GiB)")
    return parser.parse(argv)


@distributed.report_failures
def main(argv: list[str]) -> dict:
    # 1. Config: the YAML next to this file, the engine this machine can run, then the command line.
    args, overrides = parse_args(argv)
    engine_overrides, engine_note = choose_engine(overrides)
    cfg = load_config(args.config, engine_overrides + env_overrides(overrides) + overrides)

    # 2. Memory plan: refuse to start when a phase does not fit.
    if args.dry_run:
        print(engine_note)
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        prompts = prompt_tokens_for_plan(cfg)
        plan, suggestion, fixes = memory_plan(cfg, args.gpus or 8, args.gpu_mem_gib or 80.0, prompts)
        print(plan_inputs(cfg, prompts))
        print(format_plan(plan, suggestion, fixes))
        refusal = verdict(plan, fixes)
        if refusal:
            sys.exit(refusal)
        return {"dry_run": True, "fits": True, "phase_totals": plan.phase_totals}
    device = distributed.init(cfg.trainer.device, timeout_s=cfg.process_group_timeout_s)
    gpu_mem = args.gpu_mem_gib
    if gpu_mem is None and device.type == "cuda":
        import torch

        gpu_mem = torch.cuda.get_device_properties(device).total_memory / GIB
    if distributed.is_main():
        print(engine_note)
    if gpu_mem is not None:  # on CPU the device is host memory: nothing to plan for unless asked
        prompts = prompt_tokens_for_plan(cfg)
        plan, suggestion, fixes = memory_plan(cfg, args.gpus or distributed.world_size(), gpu_mem, prompts)
        refusal = verdict(plan, fixes)
        if distributed.is_main():
            print(plan_inputs(cfg, prompts))
            print(format_plan(plan, suggestion, fixes))
        if refusal:
            distributed.shutdown()
            sys.exit(refusal)

    # 3. Train (validation and logging run inside fit), then save the policy as a HF directory.
    trainer = Trainer(cfg)
    history = trainer.fit()
    trainer.save_pretrained(os.path.join(cfg.trainer.out_dir, "final_model"))
    trainer.close()

    # 4. Summary: training reward over the first and last 10% of steps, validation first and last.
    whole = run_history(cfg.trainer.out_dir, history)  # the whole run, a resumed one too
    vals = [h["val/pass@1"] for h in whole if "val/pass@1" in h]
    summary, line = reward_summary(whole, len(history))
    summary.update({"val_pass@1_last": vals[-1] if vals else None, "out_dir": cfg.trainer.out_dir})
    if distributed.is_main():
        last = summary["val_pass@1_last"]
        print(f"{line}; val pass@1 (greedy) last: {'none (no validation ran)' if last is None else f'{last:.3f}'}")
    distributed.shutdown()
    return summary


if __name__ == "__main__":
    sys.exit(command_line(main, sys.argv[1:]))  # a config error: its one line, exit 2
