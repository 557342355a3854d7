"""A real `Trainer.step` on CUDA: bf16 mixed precision under FSDP2, the cpu:gloo,cuda:nccl group
reducing host metrics and device statistics, on one GPU and (when visible) on two.
Skipped without CUDA; run on a GPU machine with `pytest tests/gpu`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _overrides(model_dir: str, out: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"trainer.out_dir={out}",
        "trainer.device=cuda",
        "trainer.progress_bar=false",
        "data.batch_size=8",
        "rollout.n=4",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=3",
        "algorithm.kl_coef=0.01",
        "algorithm.preset=dapo",
        "offload.optimizer=true",
    ]


def test_one_gpu_step_in_bf16(tiny_model_dir, tmp_path):
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.runtime import distributed as D

    try:  # the process group outlives a failed assertion otherwise, and the next D.init would reuse it
        trainer = Trainer(load_config(None, _overrides(tiny_model_dir, str(tmp_path))))
        assert D.is_dist() and torch.distributed.get_backend_config() == "cpu:gloo,cuda:nccl"
        # What the layers compute in, in the training forward (grad enabled) and the rollout: bf16
        # (FSDP2 mixed precision casts the gathered parameters), while the sharded masters stay fp32.
        seen: set[tuple[bool, torch.dtype]] = set()
        layer = next(m for m in trainer.policy.modules() if isinstance(m, torch.nn.Linear))
        hook = layer.register_forward_hook(lambda mod, args, out: seen.add((torch.is_grad_enabled(), out.dtype)))
        history = trainer.fit()
        hook.remove()
        assert (True, torch.bfloat16) in seen and all(dtype == torch.bfloat16 for _, dtype in seen), seen
        assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())
        last = history[-1]
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl_ref"):
            assert math.isfinite(last[key]), key
        assert last["actor/grad_norm"] > 0
        # bf16 forward in the engine and the trainer: close, not exact.
        assert last["rollout/logp_mismatch"] < 0.1
        assert last["memory/optimizer_peak"] > 0
        # The reference in bf16 (models/fsdp.py prepare_reference): 2 bytes a parameter, as the planner bills it.
        assert all(p.dtype == torch.bfloat16 for p in trainer.ref.parameters())
        assert last["memory/ref_peak"] == 2 * sum(p.numel() for p in trainer.ref.parameters())
        # The ledger reads the allocator's reserved bytes beside the allocated ones (what another process sees).
        assert last["memory/cuda_reserved"] >= last["memory/cuda_allocated"] > 0
        assert last["memory/cuda_reserved_peak"] >= last["memory/cuda_reserved"]
        # The rollout replayed CUDA graphs of the lean step on the FSDP2 policy, with no fallback.
        assert trainer.engine.last_decode_path == "cuda_graph", trainer.engine.last_graph_error
        params = list(trainer.policy.parameters())
        assert params[0].device.type == "cuda"
    finally:
        D.shutdown()


def test_rollout_cuda_graphs_false_decodes_the_lean_step_eagerly(tiny_model_dir, tmp_path):
    """rollout.cuda_graphs=false reaches the engine: the rollout decodes eagerly on CUDA (the GPU script's eager
    side of its eager-against-graphs measurement)."""
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.runtime import distributed as D

    overrides = _overrides(tiny_model_dir, str(tmp_path)) + ["trainer.total_steps=1", "rollout.cuda_graphs=false"]
    try:
        trainer = Trainer(load_config(None, overrides))
        trainer.fit()
        assert trainer.engine.last_decode_path == "lean", trainer.engine.last_decode_path
    finally:
        D.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_recipe_under_torchrun(tmp_path):
    from hybrid_rl.runtime.distributed import free_port

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(ROOT, "recipes", "grpo_tiny.py"),
        f"model.path={tmp_path / 'model'}",
        f"trainer.out_dir={out}",
        "trainer.total_steps=5",
        "trainer.device=cuda",
        "trainer.progress_bar=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 5 and all(math.isfinite(m["actor/loss"]) for m in lines)


@pytest.mark.parametrize("share_prompts", [None, False], ids=["shared_prefix", "packed_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_scoring_equals_padded_on_cuda(tiny_model_dir, dtype, share_prompts):
    """Both padding-free layouts against the padded one: the shared-prefix row (what the trainer's
    micro-batches take for a supported model under sdpa) and the packed rows (sdpa's block-diagonal
    mask built from the position ids; flash-attention varlen when flash_attn is installed)."""
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.logprobs import build_sequences, response_logprobs
    from hybrid_rl.models.packing import packed_response_logprobs

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 15, (1 + i % 5,), generator=g).tolist() for i in range(16)]
    responses = [torch.randint(3, 15, ((i * 7) % 10,), generator=g).tolist() for i in range(16)]
    ids, attn, mask, P = build_sequences(prompts, responses, pad_id=0, device=torch.device("cuda"))
    impls = ["sdpa"]
    try:
        import flash_attn  # noqa: F401

        impls.append("flash_attention_2")
    except ImportError:
        pass
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for impl in impls:
        if impl.startswith("flash") and dtype == torch.float32:
            continue
        model = load_causal_lm(tiny_model_dir, dtype, attn_implementation=impl).cuda()
        with torch.no_grad():
            ref, _ = response_logprobs(model, ids, attn, P)
            got, _ = packed_response_logprobs(model, ids, attn, P, min_saving=0.0, share_prompts=share_prompts)
        torch.testing.assert_close(
            got, ref * mask, atol=tol, rtol=0, msg=lambda m: f"{impl} {dtype} share_prompts={share_prompts}: {m}"
        )
