"""Bytes and seconds of one weight sync into vLLM, with and without LoRA (issue 29).

A full-parameter run sends the whole model through the engine's ordinary sync every step; a LoRA run sends the
base once and then, every step, only the adapter through vLLM's LoRA API (rollout/vllm/lora.py, in memory).
Both are timed here on the same engine kind: `--k` full syncs on an engine started without LoRA, then `--k`
adapter pushes on one started with it (the base synced once first, not timed). Random weights, adapters
perturbed so that nothing is zero; the model is the tiny recipe's or the 123M benchmark model
(rollout_throughput.py's "0.1b", V = 32000).

    python benchmarks/lora_sync.py --model tiny --rank 8
    python benchmarks/lora_sync.py --model 0.1b --rank 8 --k 3

Prints one JSON line per model: bytes per sync (full fp32 weights, adapter fp32) and the median seconds.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_bench  # noqa: E402
from rollout_throughput import MODELS  # noqa: E402  (benchmarks/ on sys.path, as the other benchmarks)


def build(model: str, vocab: int):
    """(module, model_dir): random Qwen2 weights of `model`'s shape, config.json saved (vLLM loads dummy weights)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, inter, heads, kv = MODELS[model]
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tempfile.mkdtemp(prefix="lora_sync_")
    cfg.save_pretrained(path)
    return module, path


def full_syncs(module, path: str, k: int) -> tuple[int, list[float]]:
    engine = vllm_bench.engine_for(module, path, 64, 8)
    engine.resume(["weights"])
    params = [(n, p.detach()) for n, p in module.named_parameters()]
    seconds = []
    for _ in range(k):
        t0 = time.perf_counter()
        engine.begin_weight_update()
        engine.update_weights(params)
        engine.end_weight_update()
        seconds.append(time.perf_counter() - t0)
    engine.shutdown()
    return sum(p.numel() * p.element_size() for _, p in params), seconds


def adapter_pushes(module, path: str, rank: int, k: int) -> tuple[int, list[float]]:
    from hybrid_rl.models.lora import (
        LoraSettings,
        adapter_config,
        adapter_named_tensors,
        apply_lora,
        base_named_parameters,
    )
    from hybrid_rl.rollout.vllm.lora import engine_kwargs

    policy = apply_lora(module, LoraSettings(rank=rank, alpha=2.0 * rank))
    engine = vllm_bench.engine_for(policy, path, 64, 8, engine_kwargs=engine_kwargs(rank))
    engine.resume(["weights"])
    engine.begin_weight_update()
    engine.update_weights(list(base_named_parameters(policy)))  # once per run: not timed
    engine.end_weight_update()
    seconds, sent = [], 0
    for step in range(k):
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if ".lora_" in n:
                    p.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(step))
        t0 = time.perf_counter()
        sent = engine.update_adapter(adapter_named_tensors(policy, torch.float32), adapter_config(policy))
        seconds.append(time.perf_counter() - t0)
    engine.shutdown()
    return sent, seconds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "0.1b"), default="tiny")
    p.add_argument("--vocab", type=int, default=None, help="default: 15 for tiny (the digits tokenizer), 32000 else")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--k", type=int, default=5, help="timed syncs of each kind")
    args = p.parse_args(argv)
    vocab = args.vocab or (15 if args.model == "tiny" else 32000)
    module, path = build(args.model, vocab)
    n_params = sum(p.numel() for p in module.parameters())
    full_bytes, full_s = full_syncs(module, path, args.k)
    lora_bytes, lora_s = adapter_pushes(module, path, args.rank, args.k)
    out = {
        "model": args.model,
        "params": n_params,
        "rank": args.rank,
        "full_sync_bytes": full_bytes,
        "full_sync_s_median": statistics.median(full_s),
        "adapter_sync_bytes": lora_bytes,
        "adapter_sync_s_median": statistics.median(lora_s),
        "k": args.k,
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
