"""LoRA with the SGLang adapter (rollout/sglang.py) against the CPU stand-in: no adapter-only sync, the
phase switch sends the policy with its adapters MERGED (models/lora.py merged_named_tensors) as ordinary
full weights, every step. The stand-in's greedy output must equal the native engine's on the same adapted
module, step after step, and every sync must carry exactly the base's weights under their HF names.

Catches: the unmerged base sent (the engine serves the base only), adapters sent once and then left stale,
lora_/base_layer names reaching the engine (SGLang would skip them silently).
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.engine_helpers import PROMPTS, perturbed, rollout
from tests.lora_helpers import perturb_adapters

pytestmark = pytest.mark.usefixtures("torch_one_thread", "fake_sglang")

RANK = 4


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """An adapted policy (perturbed base, non-zero adapters), an SGLang engine, the phase switch with LoRA on."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.models.lora import LoraSettings, apply_lora, trainable_parameters
    from hybrid_rl.rollout.sglang import SGLangEngine
    from hybrid_rl.switch.phases import PhaseManager

    tok = load_tokenizer(tiny_model_dir)
    policy = apply_lora(perturbed(load_causal_lm(tiny_model_dir), seed=1), LoraSettings(rank=RANK, alpha=16.0))
    policy.eval()
    opt = torch.optim.AdamW(trainable_parameters(policy), lr=1e-3)
    engine = SGLangEngine(policy, tiny_model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, tp_size=1)
    pm = PhaseManager(policy, opt, engine, torch.device("cpu"), bucket_bytes=64 << 10, lora=True)
    yield policy, engine, pm, tok
    engine.shutdown()


def _greedy():
    from hybrid_rl.rollout.base import SamplingParams

    return SamplingParams(max_new_tokens=8, greedy=True)


def _native(policy, tok):
    from hybrid_rl.rollout.native import NativeEngine

    return NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(PROMPTS, _greedy())


def _same(got, want):
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_sglang_follows_the_adapters_step_by_step_with_merged_weights(setup):
    from hybrid_rl.models.lora import adapters_disabled, base_named_parameters

    policy, engine, pm, tok = setup
    with adapters_disabled(policy):
        base_tokens = [c.token_ids for c in _native(policy, tok)]
    full = sum(p.numel() * engine.dtype.itemsize for _, p in base_named_parameters(policy))
    outputs = []
    for seed in (11, 12):  # a trainer step's effect on the adapters, twice
        perturb_adapters(policy, seed)
        got = rollout(pm, PROMPTS, _greedy())
        _same(got, _native(policy, tok))
        assert engine.sync_stats["bytes"] == full, "each sync (stats of the last one): the merged model, full, once"
        outputs.append([c.token_ids for c in got])
    assert outputs[0] != outputs[1] and base_tokens not in outputs, "the adapters must change the greedy tokens"


def test_merged_tensors_are_the_adapted_linears(setup):
    """Names are the base model's; an adapted weight is base + scaling * B @ A, the rest the base as it is."""
    from hybrid_rl.models.lora import base_named_parameters, lora_layers, merged_named_tensors

    policy, _, _, _ = setup
    merged = dict(merged_named_tensors(policy, torch.float32))
    assert set(merged) == {n for n, _ in base_named_parameters(policy)}
    assert not any("lora_" in n or "base_layer" in n for n in merged)
    names = {m: n for n, m in policy.named_modules()}
    for layer in lora_layers(policy):
        w = merged[names[layer] + ".weight"]
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
        bias = layer.base_layer.bias if layer.base_layer.bias is not None else 0
        with torch.no_grad():
            torch.testing.assert_close(x @ w.T + bias, layer(x), atol=1e-5, rtol=1e-5)
        assert not torch.equal(w, layer.base_layer.weight), "non-zero adapters must change the weight"


def test_sglang_with_lora_passes_the_engine_check():
    from hybrid_rl.models.lora import LoraSettings, check_engine

    check_engine(LoraSettings(rank=8, alpha=16.0), "sglang")


def test_trainer_steps_with_lora_on_sglang_sync_the_merged_policy(tiny_model_dir, tmp_path):
    """Through the Trainer: each step's sync is the full model in the engine's dtype (no adapter-only bytes),
    and after training the engine serves the adapted policy (greedy equals the native engine on it)."""
    import os

    from hybrid_rl import Trainer, load_config
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.models.lora import base_named_parameters
    from tests.checkpoint_helpers import ROOT, overrides

    cfg = load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
                      overrides(tiny_model_dir, str(tmp_path), f"model.lora.rank={RANK}", "rollout.engine=sglang",
                                "trainer.total_steps=2", "optim.lr=2e-2"))
    trainer = Trainer(cfg)
    try:
        history = trainer.fit()
        policy, engine = trainer.policy, trainer.engine
        perturb_adapters(policy, 13)  # trained adapters may still be near zero; make them matter for greedy
        full = sum(p.numel() * engine.dtype.itemsize for _, p in base_named_parameters(policy))
        assert [m["switch/sync_bytes"] for m in history] == [full, full]
        tok = load_tokenizer(tiny_model_dir)
        _same(rollout(trainer.phases, PROMPTS, _greedy()), _native(policy.eval(), tok))
    finally:
        trainer.engine.shutdown()
