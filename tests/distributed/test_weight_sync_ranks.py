"""The weight sync to an engine with its own copy, on 2 real gloo ranks and FSDP2 shards:
each shard is cast to the engine's dtype before the all-gather (bf16: half the bytes of the
fp32 masters), the engine gets exactly full_tensor().to(bf16), and the policy's shards, offloaded
for the rollout (offload.params), come back in place and compute the same."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed.launch import run_ranks


class GatherBytes(TorchDispatchMode):
    """Counts the bytes every all-gather on this rank produces (what the gather moves here)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "all_gather" in name or "allgather" in name:
            self.ops.add(name)
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


class Bf16CopyEngine:
    """An engine with its own bf16 copy (what SGLang's adapter declares): records what it is sent."""

    dtype = torch.bfloat16

    def __init__(self):
        self.got: dict[str, torch.Tensor] = {}

    def begin_weight_update(self) -> None:
        self.got = {}

    def update_weights(self, named_tensors) -> None:
        self.got.update((n, t.clone()) for n, t in named_tensors)

    def end_weight_update(self) -> None: ...

    def abort_weight_update(self) -> None: ...

    def release(self, tags) -> None: ...

    def resume(self, tags) -> None: ...


def _padded_numel(model, world: int) -> int:
    """Elements an all-gather of every parameter moves: FSDP2 shards dim 0 in equal (padded) chunks."""
    return sum(math.ceil(p.shape[0] / world) * world * math.prod(p.shape[1:]) for p in model.parameters())


def _sync_in_bf16(rank: int, model_dir: str) -> dict:
    from hybrid_rl.models.fsdp import reshard, shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.weights import full_tensor, iter_weight_buckets
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.switch.phases import PhaseManager

    dev = D.init("cpu", timeout_s=60)
    model = shard_model(load_causal_lm(model_dir, dtype=torch.float32), dev, False)
    assert all(p.dtype == torch.float32 and hasattr(p, "full_tensor") for p in model.parameters())
    numel, padded = sum(p.numel() for p in model.parameters()), _padded_numel(model, D.world_size())
    expected = {n: full_tensor(p.detach()).to(torch.bfloat16) for n, p in model.named_parameters()}
    out: dict = {"numel": numel, "padded": padded}

    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        with GatherBytes() as spy:
            got = dict(t for bucket in iter_weight_buckets(model, 4 << 10, dtype=dtype) for t in bucket)
        out[f"gather_{label}"], out["ops"] = spy.bytes, sorted(spy.ops)
        if dtype is not None:
            assert set(got) == set(expected)
            for n, t in got.items():
                assert t.dtype == torch.bfloat16 and torch.equal(t, expected[n]), n

    ids = torch.randint(4, 15, (2, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.clone()
    reshard(model)  # as after a training step's backward: every parameter a shard again
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = Bf16CopyEngine()
    pm = PhaseManager(model, opt, engine, dev, offload_params=True, bucket_bytes=4 << 10, always_copy=True)
    pm.param_offload.free_storage = True  # what a GPU does (on CPU the copies run, the memory stays by default)
    with GatherBytes() as spy:
        with pm.rollout():
            local = [p.to_local() for p in model.parameters()]
            out["freed_in_rollout"] = all(t.untyped_storage().nbytes() == 0 for t in local)
    out["gather_phase"] = spy.bytes
    assert set(engine.got) == set(expected)
    for n, t in engine.got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, expected[n]), n
    with pm.score():
        pass
    with pm.train():
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, logits), "the policy computes the same after the offload"
    stats = pm.pop_stats()
    out["sync_stat"], out["offload_params"] = stats.bytes["sync_weights"], stats.bytes["offload_params"]
    out["onload_params"] = stats.bytes["onload_params"]
    reshard(model)  # FSDP2 keeps the root's parameters gathered after a forward
    held = [*(p.to_local() for p in model.parameters()), *model.buffers()]  # this rank's shards, rotary buffers
    out["local_bytes"] = sum(t.numel() * t.element_size() for t in held)
    return out


def test_sync_gathers_shards_cast_to_the_engines_dtype(tiny_model_dir):
    for r in run_ranks(_sync_in_bf16, world=2, args=(tiny_model_dir,)):
        assert r["ops"], "the spy saw no all-gather: the test measures nothing"
        assert r["gather_fp32"] == r["padded"] * 4, r  # the spy's yardstick: fp32 gathers 4 bytes an element
        assert r["gather_bf16"] == r["padded"] * 2, f"bf16 sync must gather bf16 shards, not fp32 masters: {r}"
        assert r["gather_phase"] == r["padded"] * 2, f"the phase switch must gather in the engine's dtype: {r}"
        assert r["sync_stat"] == r["numel"] * 2, r  # what the ledger / metrics report as sync bytes
        assert r["freed_in_rollout"], "offload.params must free the shards' storage during the rollout"
        assert r["offload_params"] == r["onload_params"] == r["local_bytes"] > 0, r
