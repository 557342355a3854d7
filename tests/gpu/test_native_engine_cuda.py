"""The native engine on CUDA, each decode path: CUDA graphs (the default there), the lean step,
the model's forward. Still exact in fp32: greedy equals the full-forward argmax, sampled-token
logprobs equal the trainer's within 1e-5. Graphs capture only the lean step; a failed capture
leaves the allocator clean; a capped rollout stays within its planned bill. Skipped without
CUDA; run with `pytest tests/gpu` (benchmarks/gpu_session.sh runs it)."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.models.loading import load_causal_lm
from hybrid_rl.models.logprobs import build_sequences, response_logprobs
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PAD, EOS = 0, 1
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]
PATHS = {"cuda_graph": {}, "lean": {"cuda_graphs": False}, "forward": {"cuda_graphs": False, "lean_step": False}}


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
        torch.testing.assert_close(got, logp_NT[i, : len(got)], atol=1e-5, rtol=0, msg=lambda m: f"row {i}: {m}")


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_graphs_capture_on_the_fsdp2_policy(tiny_model_dir, mixed_precision):
    """The trainer's case: the engine decodes with the FSDP2-sharded policy, its shards gathered.
    The captured step is the lean one, which runs no FSDP2 hook: the root's pre-forward hook makes
    the all-gather streams wait on the capturing stream, which a capture cannot end with."""
    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.runtime import distributed as D

    dev = D.init("cuda", 120)
    try:
        policy = shard_model(load_causal_lm(tiny_model_dir, dtype=torch.float32), dev, mixed_precision)
        sp = SamplingParams(max_new_tokens=10, greedy=True)
        prompts = [p for p in PROMPTS for _ in range(4)]
        out = {}
        for path in ("cuda_graph", "lean"):
            eng = NativeEngine(
                policy, PAD, EOS, weights_dtype=torch.bfloat16 if mixed_precision else None, **PATHS[path]
            )
            eng.resume(["weights"])
            out[path] = [c.token_ids for c in eng.generate(prompts, sp)]
            eng.release(["weights"])
            assert eng.last_decode_path == path and eng.last_graph_error is None, eng.last_graph_error
        assert out["cuda_graph"] == out["lean"]
    finally:
        D.shutdown()


def _warm_cublas(model, eos: int = EOS) -> None:
    """Make torch's per-process scratch before a memory baseline: cuBLAS allocates a workspace (32 MiB on Hopper,
    + 1 MiB for cuBLASLt) through the caching allocator the first time a stream runs a matmul, and keeps it for the
    life of the process (torch's own CudaMemoryLeakCheck clears them before it compares). The engine runs matmuls
    on two streams, the current one and the graphs' capture stream (decode_graph.capture_stream); a two-token
    rollout with graphs runs both. Without this a test's baseline held them only if an earlier test had made
    them: run alone, the first test to decode counted them as its own."""
    NativeEngine(model, PAD, eos).generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, greedy=True))
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------- graphs only over the lean step
def test_no_capture_is_attempted_without_a_lean_step(model, monkeypatch):
    """A model without the lean step (here: lean_step=False) decodes with its forward on CUDA, eagerly:
    no CUDAGraph is ever begun (capturing the HF forward fails on every batch under FSDP2), and the
    reason is given once, not per batch."""
    begun = []
    real = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(
        torch.cuda.CUDAGraph, "capture_begin", lambda self, *a, **k: (begun.append(1), real(self, *a, **k))
    )
    eng = NativeEngine(model, PAD, EOS, lean_step=False, max_batch_size=2)  # two batches: two chances to capture
    with pytest.warns(UserWarning, match="CUDA graphs off") as rec:
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    assert eng.last_decode_path == "forward" and not begun
    assert sum("CUDA graphs off" in str(w.message) for w in rec) == 1
    with pytest.raises(ValueError, match="cuda_graphs=True needs the lean decode step"):
        NativeEngine(model, PAD, EOS, lean_step=False, cuda_graphs=True)


def test_graphs_capture_the_lean_step_and_leave_the_allocator_clean(model, monkeypatch):
    _warm_cublas(model)
    base = torch.cuda.memory_allocated()
    captured = []
    real = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(
        torch.cuda.CUDAGraph, "capture_begin", lambda self, *a, **k: (captured.append(1), real(self, *a, **k))
    )
    eng = NativeEngine(model, PAD, EOS)
    sp = SamplingParams(max_new_tokens=10, greedy=True)
    got = eng.generate([p for p in PROMPTS for _ in range(4)], sp)
    assert eng.last_decode_path == "cuda_graph" and captured, eng.last_graph_error
    eng.release(["kv_cache"])  # empty_cache() with no capture open
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.cuda.memory_allocated() == base  # cache, graphs and their pool all gone
    eng.resume(["kv_cache"])
    assert [c.token_ids for c in eng.generate([p for p in PROMPTS for _ in range(4)], sp)] == [c.token_ids for c in got]


def test_a_failed_capture_falls_back_and_leaves_the_allocator_clean(model, monkeypatch):
    """A host sync inside the capture invalidates it (capture_end then raises): the engine must put the
    stream back, drop the graphs and their pool, decode eagerly with the same tokens, and the next
    rollout and empty_cache() must work."""
    from hybrid_rl.rollout.native.decode_graph import DecodeGraphs

    sp = SamplingParams(max_new_tokens=8, greedy=True)
    ref = NativeEngine(model, PAD, EOS, cuda_graphs=False).generate(PROMPTS, sp)
    _warm_cublas(model)
    base = torch.cuda.memory_allocated()
    real = DecodeGraphs._forward

    def syncing(self, M):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while capturing
        return real(self, M)

    monkeypatch.setattr(DecodeGraphs, "_forward", syncing)
    eng = NativeEngine(model, PAD, EOS)
    with pytest.warns(UserWarning, match="decoding eagerly"):
        got = eng.generate(PROMPTS, sp)
    assert eng.last_decode_path == "lean" and eng.last_graph_error
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    # capture_end raised before it ended the allocation to the pool: left so, the allocator's
    # captures_underway never empties and empty_cache() fails its internal assertion.
    torch.cuda.empty_cache()
    eng.release(["kv_cache"])
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base
    eng.resume(["kv_cache"])
    assert [c.token_ids for c in eng.generate(PROMPTS, sp)] == [c.token_ids for c in ref]
    monkeypatch.setattr(DecodeGraphs, "_forward", real)  # a new engine captures (graph.__enter__ empties the cache)
    fresh = NativeEngine(model, PAD, EOS)
    assert [c.token_ids for c in fresh.generate(PROMPTS, sp)] == [c.token_ids for c in ref]
    assert fresh.last_decode_path == "cuda_graph", fresh.last_graph_error


def test_failed_captures_into_the_shared_pool_leave_empty_cache_working(model):
    """Two ways a graph size's capture fails, in turn into the same pool (then the first again): the body raises
    without invalidating the capture (capture_end succeeds; the graph's reset releases the pool), and
    a host sync invalidates it (capture_end raises before ending the allocation; DecodeGraphs ends it).
    After each the stream is back and empty_cache() works; close() finds no capture open."""
    from hybrid_rl.rollout.native.decode_graph import DecodeGraphs
    from hybrid_rl.rollout.native.kv_cache import StaticKVCache

    g = DecodeGraphs(model, StaticKVCache(4, 16), torch.device("cuda"), lean=object())

    def bug(M):
        raise ValueError("a bug in the step")

    def host_sync(M):
        torch.cuda.synchronize()  # not permitted while capturing
        raise AssertionError("the sync above should have raised")

    for broken, err in ((bug, ValueError), (host_sync, RuntimeError), (bug, ValueError)):
        g._forward = broken
        with pytest.raises(err):
            g._record(torch.cuda.CUDAGraph(), 2)
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        torch.cuda.empty_cache()
    g.close()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- the memory cap, measured
def test_measured_rollout_peak_stays_within_the_planned_bill(tmp_path):
    """A model with a real vocabulary in bf16: the memory a capped rollout allocates above its start
    stays within `rollout_memory`'s bill for the rows it chose (the bill is an upper bound)."""
    import transformers

    from hybrid_rl.models.loading import model_config
    from hybrid_rl.plan.memory import ModelArch
    from hybrid_rl.plan.rollout_memory import RolloutShape, budget_for

    cfg = transformers.Qwen2Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    m = transformers.Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(3)
    prompts = [
        torch.randint(2, 32000, (int(n),), generator=g, device="cuda").tolist()
        for n in torch.randint(20, 120, (96,), generator=g, device="cuda")
    ]
    sp = SamplingParams(max_new_tokens=64, temperature=1.0, seed=1)
    shape = RolloutShape.of(ModelArch.from_hf_config(model_config(m).to_dict()))
    free = 64 * 1024**2
    eng = NativeEngine(m, PAD, -1, free_memory=lambda dev: free)
    _warm_cublas(m, eos=-1)  # the bill leaves cuBLAS's workspaces to HEADROOM, as the CUDA context
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    capped = eng.generate(prompts, sp)
    peak = torch.cuda.max_memory_allocated() - base
    bill = budget_for(
        shape, 2, eng.last_batch_rows, eng.last_prefill_rows, max(map(len, prompts)), 64, top_p=False, graphs=True
    )
    assert eng.last_batch_rows < len(prompts)
    assert peak <= bill.peak, f"measured {peak / 2**20:.1f} MiB above the start, billed {bill.peak / 2**20:.1f} MiB"
    # (Same tokens as one big batch is a CPU test in fp32: bf16 logits move with the batch's size.)
    assert len(capped) == len(prompts) and all(c.token_ids for c in capped)
