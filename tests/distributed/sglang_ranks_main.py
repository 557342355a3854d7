"""One torchrun rank of the SGLang adapter test (tests/distributed/test_sglang_ranks.py).

Run as: torchrun --nproc_per_node=2 sglang_ranks_main.py <model_dir> <tp_size> <out_dir>
with tests/fake_sglang on PYTHONPATH. torchrun, not the test launcher: SGLang starts its
schedulers as child processes, which a daemonic worker cannot have.
Each rank samples its own prompts through the group's engine and writes what it got, plus
the native engine's greedy output on the same (gathered) weights, to <out_dir>/rank<r>.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

from hybrid_rl.models.fsdp import shard_model
from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
from hybrid_rl.models.weights import full_tensor
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.rollout.sglang.engine import SGLangEngine
from hybrid_rl.runtime import distributed as D
from hybrid_rl.switch.phases import PhaseManager
from hybrid_rl.types import SamplingParams

PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]


def main(model_dir: str, tp_size: int, out_dir: str) -> None:
    dev = D.init("cpu", timeout_s=120)
    rank = D.rank()
    torch.manual_seed(0)
    plain = load_causal_lm(model_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in plain.parameters():
            if p.dim() >= 2:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    reference = copy.deepcopy(plain)
    policy = shard_model(plain, dev, mixed_precision=False)
    tok = load_tokenizer(model_dir)
    engine = SGLangEngine(policy, model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=tp_size)
    pm = PhaseManager(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), engine, dev, bucket_bytes=64 << 10)
    prompts = PROMPTS[rank:] + PROMPTS[:rank]  # each rank its own order: slices must not mix
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    results = {}
    for step in range(2):  # the second step re-syncs after a full release
        with pm.rollout() as e:
            results[f"step{step}"] = [c.token_ids for c in e.generate(prompts, greedy)]
            results[f"logprobs{step}"] = [c.logprobs for c in e.generate(prompts, greedy)]
            sampled = e.generate(prompts * 4, SamplingParams(max_new_tokens=6, temperature=1.0, seed=step))
            results[f"sampled{step}"] = [c.token_ids for c in sampled]
            if step == 1:
                # Rank 1's prompt cannot fit the context: the owner's call fails, and every rank of
                # its group must hear it (none may wait in the scatter until the group's timeout).
                try:
                    e.generate([[5] * 300] if rank == 1 else prompts, greedy)
                    results["bad_generate"] = "no error"
                except RuntimeError as err:
                    results["bad_generate"] = str(err)
            if engine.is_owner:
                results["debug"] = engine.engine._debug_state()
        with pm.train():
            pass
    full = {n: full_tensor(p.detach()) for n, p in policy.named_parameters()}
    assert all(torch.equal(full[n], p) for n, p in reference.named_parameters()), "FSDP2 changed the weights"
    native = NativeEngine(reference, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(prompts, greedy)
    results["native"] = [c.token_ids for c in native]
    results["native_logprobs"] = [c.logprobs for c in native]
    results["sync_stats"] = engine.sync_stats
    results["is_owner"] = engine.is_owner
    results["n_params_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    engine.shutdown()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, default=str)
    D.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
