"""The native engine on CUDA, each decode path: CUDA graphs (the default there), the lean step,
the model's forward. Still exact in fp32: greedy equals the full-forward argmax, sampled-token
logprobs equal the trainer's within 1e-5. Skipped without CUDA; run with `pytest tests/gpu`."""
from __future__ import annotations

import pytest
import torch

from hybrid_rl.models.loading import load_causal_lm
from hybrid_rl.models.logprobs import build_sequences, response_logprobs
from hybrid_rl.rollout.base import SamplingParams
from hybrid_rl.rollout.native import NativeEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]
PATHS = {"cuda_graph": {}, "lean": {"cuda_graphs": False}, "forward": {"cuda_graphs": False, "lean_step": False}}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = load_causal_lm(tiny_model_dir, dtype=torch.float32).cuda().eval()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.add_(0.15 * torch.randn(p.shape, generator=g).cuda())
    return m


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_equals_full_forward_argmax_on_cuda(model, path):
    eng = NativeEngine(model, PAD, EOS, **PATHS[path])
    comps = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, greedy=True))
    assert eng.last_decode_path == path, eng.last_graph_error
    for p, c in zip(PROMPTS, comps):
        seq = list(p)
        for tok in c.token_ids:
            with torch.no_grad():
                assert model(input_ids=torch.tensor([seq], device="cuda")).logits[0, -1].argmax().item() == tok
            seq.append(tok)


@pytest.mark.parametrize("path", list(PATHS))
def test_logprobs_equal_the_trainers_on_cuda(model, path):
    prompts = [p for p in PROMPTS for _ in range(8)]
    sp = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5, stop_token_ids=(4, 7))
    eng = NativeEngine(model, PAD, EOS, **PATHS[path])
    comps = eng.generate(prompts, sp)
    assert eng.last_decode_path == path, eng.last_graph_error
    ids, attn, _, P = build_sequences(prompts, [c.token_ids for c in comps], PAD)
    with torch.no_grad():
        logp_NT, _ = response_logprobs(model, ids.cuda(), attn.cuda(), P, sp.temperature)
    for i, c in enumerate(comps):
        got = torch.tensor(c.logprobs, device="cuda")
        torch.testing.assert_close(got, logp_NT[i, :len(got)], atol=1e-5, rtol=0, msg=lambda m: f"row {i}: {m}")


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_graphs_capture_on_the_fsdp2_policy(tiny_model_dir, mixed_precision):
    """The trainer's case: the engine decodes with the FSDP2-sharded policy, its shards gathered.
    The captured step is the lean one, which runs no FSDP2 hook: the root's pre-forward hook makes
    the all-gather streams wait on the capturing stream, which a capture cannot end with."""
    from hybrid_rl import distributed as D
    from hybrid_rl.models.fsdp import shard_model

    dev = D.init("cuda", 120)
    try:
        policy = shard_model(load_causal_lm(tiny_model_dir, dtype=torch.float32), dev, mixed_precision)
        sp = SamplingParams(max_new_tokens=10, greedy=True)
        prompts = [p for p in PROMPTS for _ in range(4)]
        out = {}
        for path in ("cuda_graph", "lean"):
            eng = NativeEngine(policy, PAD, EOS, weights_dtype=torch.bfloat16 if mixed_precision else None,
                               **PATHS[path])
            eng.resume(["weights"])
            out[path] = [c.token_ids for c in eng.generate(prompts, sp)]
            eng.release(["weights"])
            assert eng.last_decode_path == path and eng.last_graph_error is None, eng.last_graph_error
        assert out["cuda_graph"] == out["lean"]
    finally:
        D.shutdown()
