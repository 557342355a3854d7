"""LoRA with the SGLang adapter (rollout/sglang/engine.py + lora.py) against the CPU stand-in: the base goes in
once, each step's sync is the adapter only (SGLang's load_lora_adapter_from_tensors under a new name, the old
one unloaded) and every generate names it in lora_path. The stand-in's greedy output must equal the native
engine's on the same adapted module, step after step, and the bytes of each sync are computed from the shapes.

Catches: the adapter not sent (a sync skipped), the base sent every step, generate without the adapter's
lora_path or with a stale one, a partial adapter, an engine started without LoRA.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.engine_helpers import PROMPTS, perturbed, rollout
from tests.lora_helpers import expected_adapter_numel, perturb_adapters

pytestmark = pytest.mark.usefixtures("torch_one_thread", "fake_sglang")

RANK = 4


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """An adapted policy (perturbed base, non-zero adapters), an SGLang engine, the phase switch with LoRA on."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.models.lora import LoraSettings, apply_lora, trainable_parameters
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
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
    from hybrid_rl.types import SamplingParams

    return SamplingParams(max_new_tokens=8, greedy=True)


def _native(policy, tok):
    from hybrid_rl.rollout.native.engine import NativeEngine

    return NativeEngine(copy.deepcopy(policy), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id).generate(
        PROMPTS, _greedy()
    )


def _same(got, want):
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def _adapter_bytes(policy, dtype) -> int:
    return expected_adapter_numel(policy.config, RANK) * dtype.itemsize  # rank x (in + out), every projection


def test_engine_starts_with_lora_from_the_policy(setup, tiny_model_dir):
    """The engine gets the rank, the adapted modules and the base's host copy (the base survives releases)."""
    _, engine, _, _ = setup
    args = engine.engine.server_args
    assert (args.enable_lora, args.max_lora_rank, args.enable_weights_cpu_backup) == (True, RANK, True)
    assert sorted(args.lora_target_modules) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]


def test_sglang_follows_the_adapters_step_by_step_adapter_bytes_only(setup):
    from hybrid_rl.models.lora import adapters_disabled, base_named_parameters

    policy, engine, pm, tok = setup
    with adapters_disabled(policy):
        base_tokens = [c.token_ids for c in _native(policy, tok)]
    base = sum(p.numel() for _, p in base_named_parameters(policy)) * engine.dtype.itemsize
    adapter = _adapter_bytes(policy, engine.dtype)
    pm.pop_stats()
    outputs, synced = [], []
    for seed in (11, 12, 13):  # a trainer step's effect on the adapters, three times
        perturb_adapters(policy, seed)
        got = rollout(pm, PROMPTS, _greedy())
        _same(got, _native(policy, tok))
        synced.append(pm.pop_stats().bytes["sync_weights"])
        outputs.append([c.token_ids for c in got])
    assert synced == [base + adapter, adapter, adapter], "the base once, then the adapter only"
    assert engine.adapter_name == "policy-v3"
    loaded = engine.engine._debug_state()["ranks"][0]["lora"]["loaded"]
    assert loaded == {"policy-v3": "__tensor__"}, "each push replaces the previous adapter"
    assert len({tuple(map(tuple, o)) for o in outputs}) == 3 and base_tokens not in outputs, (
        "the adapters must change the greedy tokens"
    )


def test_partial_or_misnamed_adapter_is_refused_before_sglang(setup):
    from hybrid_rl.models.lora import adapter_config, adapter_named_tensors

    policy, engine, pm, _ = setup
    named = list(adapter_named_tensors(policy))
    with pm.rollout():
        with pytest.raises(ValueError, match="missing"):
            engine.update_adapter(named[1:], adapter_config(policy))
        with pytest.raises(ValueError, match="unknown"):
            engine.update_adapter(
                named + [("base_model.model.lm_head.lora_A.weight", named[0][1])], adapter_config(policy)
            )
    with pm.train():
        pass


def test_sglang_lora_config_checks():
    from hybrid_rl.loop.preflight import check_engine
    from hybrid_rl.models.lora import LoraSettings

    check_engine(LoraSettings(rank=8, alpha=16.0), "sglang")
    check_engine(LoraSettings(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"]), "sglang")
    with pytest.raises(ValueError, match="model.lora.target_modules.*fc1"):
        check_engine(LoraSettings(rank=8, alpha=16.0, target_modules=["q_proj", "fc1"]), "sglang")


def test_trainer_steps_with_lora_on_sglang_sync_the_adapter_only(tiny_model_dir, tmp_path):
    """Through the Trainer: step 1 syncs base + adapter, step 2 the adapter alone (bytes from the shapes, engine
    dtype), and after training the engine serves the adapted policy (greedy equals the native engine on it)."""
    import os

    from hybrid_rl import Trainer, load_config
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.models.lora import base_named_parameters
    from tests.checkpoint_helpers import ROOT, overrides

    cfg = load_config(
        os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        overrides(
            tiny_model_dir,
            str(tmp_path),
            f"model.lora.rank={RANK}",
            "rollout.engine=sglang",
            "trainer.total_steps=2",
            "optim.lr=2e-2",
        ),
    )
    trainer = Trainer(cfg)
    try:
        history = trainer.fit()
        policy, engine = trainer.policy, trainer.engine
        base = sum(p.numel() for _, p in base_named_parameters(policy)) * engine.dtype.itemsize
        adapter = _adapter_bytes(policy, engine.dtype)
        assert [m["switch/sync_bytes"] for m in history] == [base + adapter, adapter]
        perturb_adapters(policy, 13)  # trained adapters may still be near zero; make them matter for greedy
        tok = load_tokenizer(tiny_model_dir)
        _same(rollout(trainer.phases, PROMPTS, _greedy()), _native(policy.eval(), tok))
    finally:
        trainer.engine.shutdown()
