"""LoRA through the Trainer (issue 29): the reference is the policy with its adapters off, the optimizer and the
checkpoints hold the adapters only, resume is bit-exact, the export writes the merged model or a peft adapter
directory, the native engine's sync moves nothing, and bad `model.lora.*` input is refused before any weight is read.
The vLLM engine's adapter-only sync is tests/unit/rollout/vllm/test_vllm_lora.py."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from tests.checkpoint_helpers import ROOT, overrides, straight_and_resumed

pytestmark = pytest.mark.usefixtures("torch_one_thread")
RANK = 8


def _trainer(model_dir: str, out: str, *extra: str):
    from hybrid_rl import Trainer, load_config

    return Trainer(
        load_config(
            os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
            overrides(model_dir, out, f"model.lora.rank={RANK}", *extra),
        )
    )


@pytest.fixture(scope="module")
def resumed(tiny_model_dir, tmp_path_factory):
    return straight_and_resumed(
        tiny_model_dir,
        str(tmp_path_factory.mktemp("lora_resume")),
        2,
        f"model.lora.rank={RANK}",
        "algorithm.kl_coef=0.05",
    )


def test_resume_with_lora_is_bit_exact(resumed):
    """Catches: a checkpoint without the adapters or their Adam state, or a resume that re-initialises them."""
    assert resumed["resumed"] == resumed["straight"]
    straight, again = resumed["straight_weights"], resumed["resumed_weights"]
    assert set(straight) == set(again)
    for name, t in straight.items():
        assert torch.equal(t, again[name]), name


def test_checkpoint_holds_the_adapters_and_their_optimizer_state_only(resumed):
    """Catches: the frozen base written into every checkpoint (model.path holds it already)."""
    from torch.distributed.checkpoint import FileSystemReader

    from hybrid_rl.checkpoint import sharded as ckpt

    path = ckpt.latest(os.path.join(resumed["resumed_dir"], "checkpoints"))
    keys = FileSystemReader(os.path.join(path, "state")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.state.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    assert optim_keys and all(".lora_A." in k or ".lora_B." in k for k in optim_keys), optim_keys[:5]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_merged_equals_the_adapted_policy_and_the_adapter_dir_loads_in_peft(resumed, tiny_model_dir, tmp_path):
    """Catches: an export that drops the adapters (the base model's logits), or merges them with the wrong scale."""
    from peft import PeftModel

    from hybrid_rl.checkpoint import sharded as ckpt
    from hybrid_rl.checkpoint.export import main as export_main
    from hybrid_rl.config.schema import LoraSettings
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.lora import apply_lora

    path = ckpt.latest(os.path.join(resumed["resumed_dir"], "checkpoints"))
    policy = apply_lora(load_causal_lm(tiny_model_dir), LoraSettings(rank=RANK)).eval()
    policy.load_state_dict(resumed["full_weights"])  # the trained policy, adapters included
    ids = torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11]])
    want = _logits(policy, ids)
    assert not torch.allclose(want, _logits(load_causal_lm(tiny_model_dir).eval(), ids), atol=1e-4), "adapters inert"
    assert export_main([path, str(tmp_path / "merged"), "--merge"]) == 0
    merged = load_causal_lm(str(tmp_path / "merged")).eval()
    assert not any(".lora_" in n or "base_layer" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged, ids), want, atol=1e-5, rtol=1e-5)
    assert export_main([path, str(tmp_path / "adapter")]) == 0
    assert sorted(os.listdir(tmp_path / "adapter"))[:2] == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(_logits(peft_model, ids), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def spied_run(tiny_model_dir, tmp_path_factory):
    """Three steps with a KL term; every scoring call recorded with whether the adapters were on."""
    import hybrid_rl.trainer as T
    from hybrid_rl.models.lora import lora_layers

    calls, real = [], T.score_logprobs
    params = inspect.signature(real).parameters

    def spy(*args, **kwargs):
        bound = dict(zip(params, args), **kwargs)
        off = [layer.disable_adapters for layer in lora_layers(bound["model"])]
        out = real(*args, **kwargs)
        calls.append(
            {
                "adapters_off": all(off) and bool(off),
                "args": {k: v for k, v in bound.items() if k != "model"},
                "logp": out,
            }
        )
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(T, "score_logprobs", spy)
    try:
        trainer = _trainer(
            tiny_model_dir,
            str(tmp_path_factory.mktemp("lora_spy")),
            "trainer.total_steps=3",
            "algorithm.kl_coef=0.05",
            "algorithm.kl_placement=loss",
            "optim.lr=2e-2",
        )
        history = trainer.fit()
    finally:
        mp.undo()
    return trainer, history, calls


def test_reference_is_the_base_model_to_the_bit(spied_run, tiny_model_dir):
    """Catches: the reference scored with the adapters on (the KL to the initial policy would read the trained
    policy), or a second copy of the weights built as the reference."""
    from hybrid_rl.models.loading import load_causal_lm

    trainer, history, calls = spied_run
    assert trainer.ref is None and trainer.phases.ref is None, "LoRA builds no reference model"
    refs = [c for c in calls if c["adapters_off"]]
    assert len(refs) == len(history) == 3, "one reference scoring per step, with the adapters off"
    base = load_causal_lm(tiny_model_dir).eval()
    for c in refs:
        assert torch.equal(c["logp"], trainer_score(base, c["args"])), "the reference must be the base, bitwise"
    assert history[-1]["actor/kl_ref"] > 0, "the adapters moved the policy away from the base"


def trainer_score(model, args):
    from hybrid_rl.loop.update import score_logprobs

    return score_logprobs(model, **args)


def test_optimizer_holds_the_adapters_only_and_the_base_stays(spied_run, tiny_model_dir):
    """Catches: the whole policy handed to AdamW (16 bytes per base parameter), or a base weight that moved."""
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.lora import base_named_parameters

    trainer, history, _ = spied_run
    adapters = {id(p) for n, p in trainer.policy.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert opt == adapters and set(map(id, trainer.optimizer.state)) == adapters
    base = dict(load_causal_lm(tiny_model_dir).named_parameters())
    for name, p in base_named_parameters(trainer.policy):
        assert torch.equal(p.detach(), base[name].detach()), f"frozen base weight {name} changed"
        assert p.dtype == torch.float32 and not p.requires_grad


def test_native_engine_sync_moves_nothing(spied_run):
    """The native engine decodes with the live module, adapters included: no bytes cross."""
    _, history, _ = spied_run
    assert [m["switch/sync_bytes"] for m in history] == [0, 0, 0]


@pytest.mark.parametrize(
    "extra, key",
    [
        (["model.lora.target_modules=[q_proj,nope_proj]"], "model.lora.target_modules"),
        (["model.lora.rank=100000"], "model.lora.rank"),
    ],
)
def test_bad_lora_input_is_refused_before_the_model_is_built(tiny_model_dir, tmp_path, extra, key, monkeypatch):
    """Catches: a bad target or rank found only by peft halfway through the build. (SGLang with LoRA is accepted:
    it gets merged weights, test_sglang_lora.py.)"""
    import hybrid_rl.models.fsdp as F

    monkeypatch.setattr(F, "load_causal_lm", lambda *a, **k: pytest.fail("weights read before the check"))
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        _trainer(tiny_model_dir, str(tmp_path), *extra)
