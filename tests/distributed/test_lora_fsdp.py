"""LoRA under FSDP2 (models/fsdp.py, unchanged) over 2 gloo ranks equals one plain process.

The policy is built the way the trainer will build it (`load_sharded`: rank 0 loads the model and injects and
perturbs the adapters, the other rank injects them on the meta device and receives rank 0's values), then takes
one AdamW step on a fixed batch split over the ranks. Compared with one process: the loss, every adapter's
gradient, the adapter state gathered in bf16 after the step, the reference (adapters off) log-probs against the
plain base model, and the optimizer's state (adapters only)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks
from tests.lora_helpers import batch, perturb_adapters

pytestmark = pytest.mark.slow

N = 6


def _lora_step(rank: int, model_dir: str, world: int) -> dict:
    from hybrid_rl.models.fsdp import load_sharded
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.logprobs import response_logprobs
    from hybrid_rl.models.lora import (
        LoraSettings,
        adapter_named_tensors,
        adapters_disabled,
        apply_lora,
        trainable_parameters,
    )
    from hybrid_rl.runtime import distributed as D

    dev = D.init("cpu", timeout_s=60)
    settings = LoraSettings(rank=4, alpha=8.0)
    (policy,) = load_sharded(
        model_dir,
        dev,
        False,
        "sdpa",
        [lambda m: apply_lora(m, settings)],
        load=lambda: perturb_adapters(apply_lora(load_causal_lm(model_dir), settings), 1),
    )
    ids, attn, mask, P = batch(n=N)
    rows = slice(rank * N // world, (rank + 1) * N // world)
    ids, attn, mask = ids[rows], attn[rows], mask[rows].float()
    adv = torch.linspace(-1.0, 1.0, N)[rows, None]
    opt = torch.optim.AdamW(trainable_parameters(policy), lr=1e-2)
    policy.train()
    logp = response_logprobs(policy, ids, attn, P, 1.0)[0]
    # The global token-mean loss; FSDP2 averages gradients over ranks, so each rank's share is scaled by world.
    loss = -(logp * adv * mask).sum() / mask.new_tensor(float(batch(n=N)[2].sum())) * world
    loss.backward()
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in policy.named_parameters()
        if p.grad is not None
    }
    opt.step()
    policy.eval()
    with torch.no_grad(), adapters_disabled(policy):
        ref = response_logprobs(policy, ids, attn, P, 1.0)[0]
        base = response_logprobs(load_causal_lm(model_dir).eval(), ids, attn, P, 1.0)[0]
    adapters = {id(p) for p in trainable_parameters(policy)}
    return {
        "loss": float(D.all_reduce_sum(loss.detach()) / world),
        "grads": grads,
        "state": dict(adapter_named_tensors(policy, torch.bfloat16)),
        "ref_equals_base": torch.equal(ref, base),
        "opt_state_is_adapters": bool(opt.state) and set(map(id, opt.state)) == adapters,
        "opt_state_params": len(opt.state),
        "lora_params": sum(1 for n, _ in policy.named_parameters() if ".lora_" in n),
    }


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    two = run_ranks(_lora_step, world=2, args=(tiny_model_dir, 2))
    return _lora_step(0, tiny_model_dir, 1), two


def test_two_ranks_train_the_adapters_like_one_process(runs):
    one, (r0, r1) = runs
    assert r0["loss"] == r1["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert set(r0["grads"]) == set(one["grads"]) and all(".lora_" in n for n in one["grads"]), (
        "a base parameter got a grad"
    )
    for name, g in one["grads"].items():
        torch.testing.assert_close(r0["grads"][name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"grad {name}: {m}")
    assert max(g.abs().max() for g in one["grads"].values()) > 1e-4
    for r in (r0, r1):
        assert set(r["state"]) == set(one["state"])
        for name, t in one["state"].items():
            assert t.dtype == torch.bfloat16
            torch.testing.assert_close(r["state"][name], t, rtol=1e-2, atol=1e-3, msg=lambda m: f"{name}: {m}")


def test_optimizer_state_only_for_the_adapters_on_every_rank(runs):
    one, two = runs
    for r in (one, *two):
        assert r["opt_state_is_adapters"] and r["opt_state_params"] == r["lora_params"] == 2 * 7 * 2


def test_reference_with_adapters_off_is_the_base_on_every_rank(runs):
    one, two = runs
    for r in (one, *two):
        assert r["ref_equals_base"]
