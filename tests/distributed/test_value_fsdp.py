"""The critic (models/value.py) under FSDP2 on 2 real gloo ranks, built by `models.fsdp.load_sharded` as the
trainer builds the policy: rank 0 alone reads the directory, the value head is sharded with the root module,
values and gradients (with gradient checkpointing) equal one process's, and save_value_model gathers it back."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow

PROMPTS = [[2, 4, 5], [2, 6], [2, 7, 8, 9, 4]]
RESPONSES = [[5, 6, 7, 1], [8], [9, 4, 1]]


def _scaled_head_dir(src: str, dst: str) -> str:
    """A critic directory whose head is large enough that a misaligned value would show."""
    from hybrid_rl.models.value import load_value_model, save_value_model

    critic = load_value_model(src)
    with torch.no_grad():
        critic.value_head.weight.mul_(50.0)
        critic.value_head.bias.fill_(0.3)
    return save_value_model(critic, dst)


def _values_and_grads(model):
    from hybrid_rl.models.logprobs import build_sequences
    from hybrid_rl.models.value import response_values

    ids, attn, mask, P = build_sequences(PROMPTS, RESPONSES, 0)
    model.train()
    values = response_values(model, ids, attn, P)
    (values * mask).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.detach().clone()
    return values.detach(), grads


def _on_rank(rank: int, model_dir: str, out_dir: str):
    from hybrid_rl.models import fsdp, value
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    reads = []

    def load():
        reads.append(1)
        return value.load_value_model(model_dir)

    (critic,) = fsdp.load_sharded(
        model_dir,
        torch.device("cpu"),
        False,
        "sdpa",
        [lambda m: fsdp.prepare_policy(m, gradient_checkpointing=True)],
        load=load,
        model_class=value.ValueModel,
    )
    values, grads = _values_and_grads(critic)
    value.save_value_model(critic, out_dir)
    return {
        "reads": len(reads),
        "head_sharded": all(type(p).__name__ == "DTensor" for p in critic.value_head.parameters()),
        "is_fsdp": [type(m).__name__.startswith("FSDP") for m in (critic, *fsdp.decoder_layers(critic))],
        "checkpointing": critic.is_gradient_checkpointing,
        "values": values,
        "grads": grads,
    }


def test_sharded_critic_equals_one_process(tiny_model_dir, tmp_path):
    from hybrid_rl.models.value import load_value_model

    src = _scaled_head_dir(tiny_model_dir, str(tmp_path / "critic"))
    want_values, want_grads = _values_and_grads(load_value_model(src))
    r0, r1 = run_ranks(_on_rank, world=2, args=(src, str(tmp_path / "saved")), timeout=180)
    assert (r0["reads"], r1["reads"]) == (1, 0), "rank 1 must never read the weights"
    for r in (r0, r1):
        assert r["head_sharded"] and all(r["is_fsdp"]) and r["checkpointing"]
        assert torch.allclose(r["values"], want_values, atol=1e-5)
        assert r["grads"].keys() == want_grads.keys()
        for name, g in want_grads.items():
            # Both ranks ran the same batch: FSDP2's averaged gradient is one process's gradient.
            assert torch.allclose(r["grads"][name], g, rtol=1e-4, atol=1e-6), name
    saved = load_value_model(str(tmp_path / "saved"))
    for k, v in load_value_model(src).state_dict().items():
        assert torch.equal(saved.state_dict()[k], v), k
