"""`models.fsdp.load_sharded` on 2 real gloo ranks: only rank 0 reads the weights; every rank ends with
the same whole model as a plain load (parameters, the non-persistent rotary buffer, the generation
config, tied embeddings), the policy trainable with gradient checkpointing, the reference frozen and in bf16
(`prepare_reference`: its meta parameters cast, rank 0's fp32 weights copied into the bf16 shards, buffers fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow


def _load_on_rank(rank: int, model_dir: str):
    import functools

    from hybrid_rl.models import fsdp
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    reads = []
    real = fsdp.load_causal_lm
    fsdp.load_causal_lm = lambda *a, **k: reads.append(a[0]) or real(*a, **k)
    policy, ref = fsdp.load_sharded(
        model_dir,
        torch.device("cpu"),
        False,
        "sdpa",
        [lambda m: m.gradient_checkpointing_enable(), functools.partial(fsdp.prepare_reference, dtype=torch.bfloat16)],
    )
    out = {"reads": len(reads)}
    for name, model in (("policy", policy), ("ref", ref)):
        out[name] = {
            # full_tensor(): an all-gather, so every rank reports the whole model as the ranks hold it
            "state": {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()},
            "buffers": {k: v.clone() for k, v in model.named_buffers()},
            "generation": model.generation_config.to_dict(),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "trainable": {p.requires_grad for p in model.parameters()},
            "checkpointing": model.is_gradient_checkpointing,
            "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        }
    return out


def test_only_rank_0_reads_and_every_rank_holds_the_model(tiny_model_dir):
    from hybrid_rl.models.loading import load_causal_lm

    plain = load_causal_lm(tiny_model_dir)
    want_state = plain.state_dict()
    want_buffers = dict(plain.named_buffers())
    assert "model.rotary_emb.inv_freq" in want_buffers and "model.rotary_emb.inv_freq" not in want_state
    r0, r1 = run_ranks(_load_on_rank, world=2, args=(tiny_model_dir,), timeout=180)
    assert (r0["reads"], r1["reads"]) == (1, 0), "rank 1 must never read the weights"
    for r in (r0, r1):
        for name in ("policy", "ref"):
            m = r[name]
            assert m["state"].keys() == want_state.keys()
            for k, v in want_state.items():
                assert torch.equal(m["state"][k], v if name == "policy" else v.to(torch.bfloat16)), (name, k)
            for k, v in want_buffers.items():
                assert m["buffers"][k].dtype == v.dtype and torch.equal(m["buffers"][k], v), (name, k)
            assert m["generation"] == plain.generation_config.to_dict() and m["tied"] and m["sharded"]
        assert r["policy"]["trainable"] == {True} and r["policy"]["checkpointing"]
        assert r["ref"]["trainable"] == {False} and not r["ref"]["checkpointing"]


def _load_broken_on_rank(rank: int, model_dir: str):
    from hybrid_rl.models import fsdp
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    try:
        fsdp.load_sharded(model_dir, torch.device("cpu"), False, "sdpa", [lambda m: m])
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_a_model_rank_0_cannot_read_stops_every_rank_at_once(tiny_model_dir, tmp_path):
    """Only rank 0 reads the weights: when it cannot, the others must hear it, not wait in the broadcast."""
    import os
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    os.remove(broken / "model.safetensors")
    r0, r1 = run_ranks(_load_broken_on_rank, world=2, args=(str(broken),), timeout=60)
    assert r0.startswith("OSError") or "safetensors" in r0 or "weights" in r0, r0
    assert r1.startswith("RuntimeError: rank 0 could not load the model") and str(broken) in r1, r1
