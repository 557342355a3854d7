"""One torchrun rank of the vLLM adapter test (tests/distributed/test_vllm_ranks.py).

Run as: torchrun --nproc_per_node=2 vllm_ranks_main.py <model_dir> <tp_size> <out_dir>
Each rank builds its engine with external_launcher (tp_size consecutive ranks per engine) over an
FSDP2-sharded policy, asks for its own prompts (in its own order) and writes what it got, plus the
native engine's greedy output on the same gathered weights, to <out_dir>/rank<r>.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

from hybrid_rl.models.fsdp import shard_model
from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.rollout.vllm.engine import VLLMEngine
from hybrid_rl.runtime import distributed as D
from hybrid_rl.switch.phases import PhaseManager
from hybrid_rl.types import SamplingParams
from tests.engine_helpers import perturbed

PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]


def main(model_dir: str, tp_size: int, out_dir: str) -> None:
    dev = D.init("cpu", timeout_s=120)
    rank = D.rank()
    plain = perturbed(load_causal_lm(model_dir), seed=1)
    reference = copy.deepcopy(plain)
    policy = shard_model(plain, dev, mixed_precision=False)
    tok = load_tokenizer(model_dir)
    engine = VLLMEngine(
        policy,
        model_dir,
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
        max_model_len=64,
        sequences=16,
        tp_size=tp_size,
    )
    pm = PhaseManager(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), engine, dev, bucket_bytes=64 << 10)
    prompts = (PROMPTS[rank:] + PROMPTS[:rank])[: 3 + rank]  # each rank its own prompts, order and count
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    results = {"local_world_size": os.environ.get("LOCAL_WORLD_SIZE")}
    for step in range(2):  # the second step re-syncs after a full release
        with pm.rollout() as e:
            got = e.generate(prompts, greedy)
            results[f"step{step}"] = [c.token_ids for c in got]
            results[f"logprobs{step}"] = [c.logprobs for c in got]
            sampled = e.generate(prompts * 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=step + 7 * rank))
            results[f"sampled{step}"] = [c.token_ids for c in sampled]
        with pm.train():
            pass
    native = NativeEngine(reference, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(prompts, greedy)
    results["native"] = [c.token_ids for c in native]
    results["native_logprobs"] = [c.logprobs for c in native]
    results["sync_bytes"] = engine.sync_stats["bytes"]
    results["n_params_bytes"] = sum(p.numel() * 4 for p in reference.parameters())
    engine.shutdown()
    D.barrier()  # the trainer's group survives the engine's shutdown
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    D.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
