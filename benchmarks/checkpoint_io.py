"""What a checkpoint costs: bytes on disk, save, load and export seconds, through the library's
own code (`hybrid_rl/checkpoint/sharded.py`, `hybrid_rl/checkpoint/export.py`).

Builds a Qwen2 with random weights (`--model tiny`: the demo's 128 x 2 layers; `--model 123m`:
hidden 1024, 8 layers, vocab 32000, as benchmarks/phase_swap.py), shards it with FSDP2 when
launched under torchrun, gives AdamW real state with one step, then `--k` times: save a
checkpoint, load it into a fresh optimizer's state (the resume path), and export it to a HF
directory on rank 0 (one process, no group).

    python benchmarks/checkpoint_io.py --model 123m
    torchrun --nproc_per_node=2 benchmarks/checkpoint_io.py --model 123m

Prints a table, then one JSON object as the last line. `main(argv) -> dict`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hybrid_rl.checkpoint import sharded as C  # noqa: E402
from hybrid_rl.models.fsdp import shard_model  # noqa: E402
from hybrid_rl.runtime import distributed as D  # noqa: E402

MODELS = {
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, vocab=16),
    "123m": dict(hidden=1024, layers=8, heads=16, kv_heads=4, vocab=32000),
}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv: list[str]) -> dict:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hybrid_rl.checkpoint.export import export_checkpoint
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="123m")
    p.add_argument("--k", type=int, default=3, help="measured save/load/export rounds")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    D.init("cpu", 300)
    m = MODELS[args.model]
    root = D.broadcast_object_from(args.dir or tempfile.mkdtemp(prefix="ckpt_io_"), 0)
    model_dir = os.path.join(root, "model")
    if D.is_main():  # a tokenizer for the hf/ part of the checkpoint; the model itself is built below
        build_tiny_model_dir(model_dir, DIGIT_WORDS, hidden_size=32, num_layers=1)
    D.barrier()
    from hybrid_rl.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    cfg = Qwen2Config(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=32 * round(2.75 * m["hidden"] / 32),
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = shard_model(AutoModelForCausalLM.from_config(cfg), torch.device("cpu"), False)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()) if D.is_main() else 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, m["vocab"], (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    def write_hf(d):
        os.makedirs(d, exist_ok=True)
        cfg.save_pretrained(d)
        tokenizer.save_pretrained(d)

    saves, loads, exports = [], [], []
    ckpt_root = os.path.join(root, "checkpoints")
    for step in range(1, args.k + 1):
        t0 = time.perf_counter()
        path = C.save(
            ckpt_root, step, model, opt, {"step": step, "rng": C.rng_state()}, {"model": {}, "config": {}}, write_hf
        )
        saves.append(D.all_reduce_max(torch.tensor([time.perf_counter() - t0], dtype=torch.float64)).item())
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-4)
        t0 = time.perf_counter()
        C.load(path, model, fresh)
        loads.append(D.all_reduce_max(torch.tensor([time.perf_counter() - t0], dtype=torch.float64)).item())
        if D.is_main():
            t0 = time.perf_counter()
            export_checkpoint(path, os.path.join(root, "hf_export"))
            exports.append(time.perf_counter() - t0)
        D.barrier()
        C.prune(ckpt_root, 1)
        D.barrier()
    result = {}
    if D.is_main():
        size = _dir_bytes(path)
        hw = (
            open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t")
            if os.path.isfile("/proc/cpuinfo")
            else "unknown"
        )
        result = {
            "model": args.model,
            "params": params,
            "ranks": D.world_size(),
            "checkpoint_bytes": size,
            "state_bytes": _dir_bytes(os.path.join(path, "state")),
            "save_s": statistics.median(saves),
            "load_s": statistics.median(loads),
            "export_s": statistics.median(exports),
            "export_bytes": _dir_bytes(os.path.join(root, "hf_export")),
            "hardware": f"{hw}, {os.cpu_count()} cores, torch {torch.__version__}",
            "date": time.strftime("%Y-%m-%d"),
            "k": args.k,
        }
        print(
            f"{args.model}: {params / 1e6:.1f}M params, {D.world_size()} rank(s): checkpoint "
            f"{size / 1e6:.1f} MB (weights + AdamW m, v in fp32), save {result['save_s']:.2f} s, "
            f"load {result['load_s']:.2f} s, export {result['export_s']:.2f} s "
            f"({result['export_bytes'] / 1e6:.1f} MB HF dir)"
        )
        print(json.dumps(result))
    D.shutdown()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
