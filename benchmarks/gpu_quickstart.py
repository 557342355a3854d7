"""The README's one-GPU quickstart at its real shape, for a few steps: what benchmarks/gpu_session.sh runs.

The README runs `recipes/grpo_7b.py` on Qwen2.5-1.5B-Instruct. The GPU machine has neither the weights nor
network, so the model is a random one of Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads and 2 KV heads,
MLP 8960, tied embeddings) with the real vocabulary size (151,936), initialised on the GPU and saved in bf16 as
a normal HF directory, with the byte-level text tokenizer of models/tiny_text.py (its 261 ids are the first of
the 151,936; an id past them decodes to nothing). Everything else is the README's command: the recipe's YAML,
its overrides (one GPU, native engine, 64 prompts x 8 samples, optimizer steps of 256 sequences), GSM8K
prompts, bf16 mixed precision, and the recipe's own memory-plan gate, which refuses before anything is built
when a phase does not fit. Changed for the time a lent GPU has: 512 new tokens (the recipe's 1024 halved),
`trainer.total_steps` (2), no validation and no checkpoint (the recipe's final save writes 18 GB of
weights and optimizer state). Random weights almost never sample the EOS, so every completion runs its 512
tokens: the rollout measured is the longest this configuration can make.

Kept: the per-step metrics, the memory ledger of the last step (per phase boundary: the bytes per role, the
allocator's allocated and reserved bytes and their peaks), the planner's bill for the same config, the run
directory (metrics.jsonl, memory.txt) and the log. Written to `--out`: quickstart.json, run/ (and the model,
3 GB on a GPU, to `--model-dir`).

    python benchmarks/gpu_quickstart.py --out /tmp/qs                 # on a GPU
    python benchmarks/gpu_quickstart.py --out /tmp/qs --dry           # CPU: a tiny model, the same plumbing

Prints a human table, then one JSON object as the last line. `main(argv) -> dict`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import runpy
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # phase_swap beside this script
from phase_swap import hardware  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Qwen2.5-1.5B-Instruct's config.json, less what a random model has no use for.
QWEN25_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151_936,
    max_position_embeddings=32_768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# The README's one-GPU command (README "One-GPU quickstart"), on this machine's engine and data.
README_OVERRIDES = [
    "rollout.engine=native",
    "rollout.tp_size=1",
    "data.batch_size=64",
    "rollout.n=8",
    "algorithm.mini_batch_size=256",
    "data.val_batch_size=512",
]
# What a lent GPU's minutes allow (module docstring).
SESSION_OVERRIDES = [
    "rollout.max_new_tokens=512",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "trainer.save_every=0",
    "trainer.progress_bar=false",
    "trainer.loggers=[console]",
]
# --dry: the same path on a CPU, small enough for CI.
DRY_OVERRIDES = [
    "trainer.device=cpu",
    "data.batch_size=2",
    "rollout.n=2",
    "algorithm.mini_batch_size=0",
    "rollout.max_new_tokens=8",
    "data.max_prompt_tokens=384",
    "trainer.micro_batch_size=4",
]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for quickstart.json and the run")
    p.add_argument("--model-dir", default="", help="where the random model is saved (default: --out/model)")
    p.add_argument("--data", default="", help="GSM8K directory (train.jsonl, test.jsonl); default: data.path's")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dry", action="store_true", help="CPU, a tiny model: checks the plumbing")
    p.add_argument("overrides", nargs="*", help="more key=value overrides, applied last")
    args = p.parse_args(argv)
    if args.steps <= 0:
        p.error("--steps must be > 0")
    return args


def build_model_dir(path: str, device: torch.device, dry: bool) -> str:
    """The random model (module docstring), built on `device` and saved in bf16; tiny on --dry."""
    from hybrid_rl.models.tiny_text import build_text_tokenizer, build_tiny_text_model_dir

    if dry:
        return build_tiny_text_model_dir(path, hidden_size=64, num_layers=2, max_positions=1024, overwrite=True)
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hybrid_rl.models.saving import atomic_dir, save_weights_quietly

    tok = build_text_tokenizer()
    cfg = Qwen2Config(
        **QWEN25_15B, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    torch.manual_seed(0)
    with torch.device(device):  # on the host, the init of 1.5B parameters alone takes a minute
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with atomic_dir(path) as tmp:
        save_weights_quietly(model, tmp)
        tok.save_pretrained(tmp)
    del model
    torch.cuda.empty_cache()
    return path


def snapshots(ledger, rollout: int) -> list[dict]:
    """The ledger's boundaries of one cycle, in bytes (roles, and the allocator's view on CUDA)."""
    out = []
    for s in ledger.rollout_snapshots(rollout):
        row = {"label": s.label, "roles": dict(s.roles), "total": s.total}
        if s.allocated is not None:
            row.update(allocated=s.allocated, peak=s.peak, reserved=s.reserved, reserved_peak=s.reserved_peak)
        out.append(row)
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    dev = torch.device("cpu" if args.dry else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_quickstart: no CUDA device (use --dry on a CPU)")
    recipe = runpy.run_path(os.path.join(ROOT, "recipes", "grpo_7b.py"), run_name="grpo_7b")
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.plan.memory import GIB
    from hybrid_rl.runtime import distributed as D

    t0 = time.perf_counter()
    model_dir = build_model_dir(args.model_dir or os.path.join(args.out, "model"), dev, args.dry)
    build_s = time.perf_counter() - t0
    overrides = README_OVERRIDES + SESSION_OVERRIDES + (DRY_OVERRIDES if args.dry else [])
    overrides += [f"model.path={model_dir}", f"trainer.out_dir={os.path.join(args.out, 'run')}"]
    overrides += [f"trainer.total_steps={args.steps}"] + ([f"data.path={args.data}"] if args.data else [])
    cfg = load_config(os.path.join(ROOT, "recipes", "grpo_7b.yaml"), overrides + list(args.overrides))
    result = {
        "benchmark": "gpu_quickstart",
        "date": datetime.date.today().isoformat(),
        "dry": args.dry,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "hardware": hardware(dev),
        "overrides": overrides + list(args.overrides),
        "model_build_s": round(build_s, 1),
    }
    if dev.type == "cuda":  # the recipe's gate, as `torchrun recipes/grpo_7b.py` applies it at start
        gpu_gib = torch.cuda.get_device_properties(dev).total_memory / GIB
        plan, suggestion, fixes = recipe["memory_plan"](cfg, 1, gpu_gib)
        result["plan_gb"] = {phase: round(b / 1e9, 2) for phase, b in plan.phase_totals.items()}
        result["plan_per_gpu"] = dict(plan.per_gpu)
        refusal = recipe["verdict"](plan, fixes)
        if refusal:
            result["refused"] = refusal
            print(json.dumps(result))
            raise SystemExit(f"gpu_quickstart: the recipe's gate {refusal}")
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    result["trainer_init_s"] = round(time.perf_counter() - t0, 1)
    try:
        history = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            history.append(trainer.step())
            history[-1]["wall_s"] = round(time.perf_counter() - t0, 2)
            print(
                f"step {len(history)}: {history[-1]['wall_s']} s, reward {history[-1]['reward/mean']:.3f}",
                flush=True,
            )
        ledger = trainer.phases.ledger
        result.update(
            steps=history,
            ledger=snapshots(ledger, trainer.phases.rollouts),
            ledger_table=ledger.table(trainer.phases.rollouts),
            decode_path=getattr(trainer.engine, "last_decode_path", None),
            graph_error=getattr(trainer.engine, "last_graph_error", None),
            ref_dtype=str(next(iter(trainer.ref.parameters())).dtype) if trainer.ref is not None else None,
        )
        ledger.write_report(trainer.phases.rollouts, cfg.trainer.out_dir, trainer.offload.message)
    finally:
        trainer.close()
        D.shutdown()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    with open(os.path.join(args.out, "quickstart.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nquickstart: {args.steps} steps on {result['hardware'].get('gpu') or 'cpu'}")
    print(f"{'step':>4} {'wall s':>8} {'rollout s':>10} {'score s':>8} {'train s':>8} {'switch s':>9} {'reward':>7}")
    for i, m in enumerate(history, 1):
        print(
            f"{i:>4} {m['wall_s']:>8.2f} {m.get('time/rollout', 0):>10.2f} {m.get('time/score', 0):>8.2f} "
            f"{m.get('time/train', 0):>8.2f} {m.get('time/switch', 0):>9.2f} {m['reward/mean']:>7.3f}"
        )
    print(result["ledger_table"])
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
