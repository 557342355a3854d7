"""The phase switch: legal order only, a full round trip changes nothing, and the policy holds only
its shards between phases."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _snapshot(model, opt) -> tuple[dict, list]:
    params = {n: _local(p) for n, p in model.named_parameters()}
    state = [(k, _local(v)) for s in opt.state.values() for k, v in sorted(s.items()) if isinstance(v, torch.Tensor)]
    return params, state


def _setup(model_dir: str, offload_optimizer: bool, with_ref: bool):
    import copy

    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.switch.phases import PhaseManager

    dev = D.init("cpu", timeout_s=60)
    base = load_causal_lm(model_dir)
    ref = shard_model(copy.deepcopy(base).requires_grad_(False), dev, False) if with_ref else None
    model = shard_model(base, dev, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # One real step so the optimizer has state to move.
    ids = torch.randint(4, 15, (2, 6), generator=torch.Generator().manual_seed(D.rank()))
    model(input_ids=ids).logits.square().mean().backward()
    opt.step()
    model(input_ids=ids).logits.square().mean().backward()  # leave grads behind: the switch must drop them
    engine = NativeEngine(model, pad_id=0, eos_id=1)
    # always_copy: on CPU the offload copies really run (into host buffers and back).
    pm = PhaseManager(
        model, opt, engine, dev, ref=ref, offload_optimizer=offload_optimizer, offload_ref=True, always_copy=True
    )
    return model, opt, pm


def _roundtrip(model_dir: str, offload_optimizer: bool) -> bool:
    from hybrid_rl.types import SamplingParams

    model, opt, pm = _setup(model_dir, offload_optimizer, with_ref=True)
    before = _snapshot(model, opt)
    with pm.rollout() as engine:
        full = [p for p in model.parameters()]
        out = engine.generate([[4, 5, 6], [7]], SamplingParams(max_new_tokens=4, seed=1))
        assert len(out) == 2
    with pm.score() as ref:
        assert ref is not None
    with pm.train():
        pass
    after = _snapshot(model, opt)
    assert all(p.grad is None for p in model.parameters()), "entering rollout must free gradients"
    for n in before[0]:
        assert torch.equal(before[0][n], after[0][n]), f"parameter {n} changed"
        assert after[0][n].numel() == before[0][n].numel(), "weights must be sharded again after rollout"
    assert len(before[1]) == len(after[1]) > 0
    for (k0, v0), (k1, v1) in zip(before[1], after[1]):
        assert k0 == k1 and torch.equal(v0, v1), f"optimizer state {k0} changed"
    if offload_optimizer:
        # One flat host buffer (switch/offload.py): every state tensor's bytes, each start aligned.
        state = [v.numel() * v.element_size() for _, v in before[1] if v.dim() > 0]
        align = pm.opt_offload._ALIGN
        assert sum(state) <= pm.opt_offload.host_bytes() < sum(state) + align * len(state)
    stats = pm.pop_stats()
    if offload_optimizer:
        assert stats.bytes["offload_optimizer"] == stats.bytes["onload_optimizer"] > 0
    assert stats.bytes["onload_ref"] == stats.bytes["offload_ref"] > 0
    expected = {"zero_grad", "resume_weights", "resume_kv", "release_engine", "onload_ref", "offload_ref"}
    if offload_optimizer:
        expected |= {"offload_optimizer", "onload_optimizer"}
    assert expected <= set(stats.seconds), f"missing stage timings: {expected - set(stats.seconds)}"
    del full
    return True


def _rank_fn(rank: int, model_dir: str, offload_optimizer: bool) -> bool:
    return _roundtrip(model_dir, offload_optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_roundtrip_bit_identical_two_ranks(tiny_model_dir, offload_optimizer):
    assert run_ranks(_rank_fn, world=2, args=(tiny_model_dir, offload_optimizer)) == [True, True]


@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_roundtrip_bit_identical_one_process(tiny_model_dir, offload_optimizer):
    assert _roundtrip(tiny_model_dir, offload_optimizer)


def test_illegal_transitions_raise(tiny_model_dir):
    from hybrid_rl.switch.phases import Phase, PhaseError

    _, _, pm = _setup(tiny_model_dir, offload_optimizer=False, with_ref=False)
    assert pm.phase is Phase.TRAIN
    with pytest.raises(PhaseError, match="cannot go from train to score"):
        with pm.score():
            pass
    with pytest.raises(PhaseError, match="cannot go from train to train"):
        with pm.train():
            pass
    with pm.rollout():
        with pytest.raises(PhaseError, match="while inside rollout"):
            with pm.score():
                pass
    with pytest.raises(PhaseError, match="cannot go from rollout to rollout"):
        with pm.rollout():
            pass
    with pm.score():
        pass
    with pm.train():
        pass
    assert pm.phase is Phase.TRAIN


def _sharded(model) -> bool:
    """Every parameter is this rank's shard (FSDP2 swaps in plain full tensors while gathered)."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters())


def _residency_through_the_phases(rank: int, model_dir: str, own_weights: bool):
    import copy

    import torch

    from hybrid_rl.loop.update import score_logprobs
    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.logprobs import build_sequences
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.switch.phases import PhaseManager
    from hybrid_rl.types import SamplingParams

    dev = D.init("cpu", timeout_s=60)
    base = load_causal_lm(model_dir)
    # own_weights: an engine with its own (unsharded) copy that the switch syncs, as SGLang has.
    engine_model = copy.deepcopy(base) if own_weights else None
    model = shard_model(base, dev, False)
    engine = NativeEngine(engine_model if own_weights else model, pad_id=0, eos_id=1, own_weights=own_weights)
    pm = PhaseManager(model, torch.optim.AdamW(model.parameters(), lr=1e-3), engine, dev)
    seen = {"start": _sharded(model)}
    with pm.rollout() as engine:
        seen["rollout"] = _sharded(model)
        out = engine.generate([[4, 5, 6], [7, 8]], SamplingParams(max_new_tokens=3, seed=rank))
    seen["after_rollout"] = _sharded(model)
    with pm.score():
        ids, attn, _, P = build_sequences([[4, 5, 6], [7, 8]], [c.token_ids for c in out], pad_id=0)
        score_logprobs(model, ids, attn, P, 1.0, micro_batch_size=2)
        seen["scored"] = _sharded(model)
    seen["after_score"] = _sharded(model)
    with pm.train():
        pass
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("own_weights", [False, True], ids=["zero_copy_engine", "copy_engine"])
def test_the_policy_holds_only_its_shards_between_phases(tiny_model_dir, own_weights):
    """Catches a phase switch that forgets to free gathered weights: the native engine's release
    without release_full_weights (zero-copy: the whole policy stays gathered after ROLLOUT), or
    SCORE without reshard(policy) (copy engine: FSDP2 keeps the root module's parameters gathered
    after the scoring forward, since by default it expects a backward next)."""
    for seen in run_ranks(_residency_through_the_phases, world=2, args=(tiny_model_dir, own_weights), timeout=120):
        assert seen["start"], seen
        if own_weights:
            assert seen["rollout"] and not seen["scored"], f"the test must see the scoring forward gather: {seen}"
        else:
            assert not seen["rollout"], f"the zero-copy engine decodes with gathered weights: {seen}"
        assert seen["after_rollout"], "leaving ROLLOUT must free the gathered weights"
        assert seen["after_score"], "leaving SCORE must free what the scoring forward gathered"
