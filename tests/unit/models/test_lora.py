"""LoRA through peft (hybrid_rl/models/lora.py), one process: the `model.lora.*` checks before a model is built,
the injected adapters (base frozen, fp32 adapters over a lower-precision base, optimizer state for the adapters
alone), the reference as the policy with its adapters off (bit-exact to the base), and the adapter-only state a
sync sends (peft's names, the bytes from the shapes, a directory peft loads back)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from tests.lora_helpers import batch, expected_adapter_numel, perturb_adapters

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _lora(rank=8, **kw):
    from hybrid_rl.models.lora import LoraSettings

    return LoraSettings(rank=rank, **kw)


def _adapted(model_dir, settings=None, dtype=torch.float32, seed=1):
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.lora import apply_lora

    return perturb_adapters(apply_lora(load_causal_lm(model_dir, dtype=dtype).eval(), settings or _lora()), seed)


def _logp(model, seq):
    from hybrid_rl.models.logprobs import response_logprobs

    ids, attn, _, P = seq
    with torch.no_grad():
        return response_logprobs(model, ids, attn, P, 1.0)[0]


# -- settings and checks before a model is built -----------------------------------------------
@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(rank=-1), "rank"),
        (dict(rank=2.5), "rank"),
        (dict(alpha=0), "alpha"),
        (dict(dropout=1.0), "dropout"),
        (dict(target_modules="q_proj"), "target_modules"),
        (dict(target_modules=[]), "target_modules"),
        (dict(target_modules=["q_proj", "q_proj"]), "target_modules"),
    ],
)
def test_bad_settings_name_their_key(kw, key):
    from hybrid_rl.models.lora import LoraSettings

    with pytest.raises(ValueError, match=rf"config key 'model\.lora\.{key}'"):
        LoraSettings(**{"rank": 8, **kw})


@pytest.fixture
def no_weights_read(monkeypatch):
    from transformers import AutoModelForCausalLM

    def fail(*a, **k):
        raise AssertionError("the checks read the model's weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fail)


def test_a_target_matching_nothing_is_refused_before_any_weight_is_read(tiny_model_dir, no_weights_read):
    from hybrid_rl.models.lora import check_model_dir

    with pytest.raises(ValueError, match=r"'model\.lora\.target_modules': 'qproj' matches no linear layer.*'q_proj'"):
        check_model_dir(_lora(target_modules=["q_proj", "qproj"]), tiny_model_dir)
    with pytest.raises(ValueError, match="'model.lora.target_modules': 'self_attn' matches no linear layer"):
        check_model_dir(_lora(target_modules=["self_attn"]), tiny_model_dir)  # a module, not a Linear


def test_a_rank_above_a_target_layers_width_is_refused(tiny_model_dir, tiny_model, no_weights_read):
    from hybrid_rl.models.lora import check_model_dir

    kv_width = tiny_model.config.num_key_value_heads * (
        tiny_model.config.hidden_size // tiny_model.config.num_attention_heads
    )
    assert check_model_dir(_lora(rank=kv_width), tiny_model_dir)  # the widest rank allowed passes
    with pytest.raises(ValueError, match=rf"'model\.lora\.rank': {kv_width + 1} is larger than the width of .*k_proj"):
        check_model_dir(_lora(rank=kv_width + 1), tiny_model_dir)
    # Not a target, not checked: q_proj and the MLP are wider than k_proj.
    assert check_model_dir(_lora(rank=kv_width + 1, target_modules=["q_proj", "up_proj"]), tiny_model_dir)


def test_an_adapter_directory_as_model_path_is_refused(tiny_model_dir, tmp_path):
    from hybrid_rl.models.lora import check_model_dir, save_adapter_dir

    adapter = str(tmp_path / "adapter")
    save_adapter_dir(_adapted(tiny_model_dir), adapter)
    with pytest.raises(ValueError, match=r"config key 'model\.path': .* is a peft adapter directory"):
        check_model_dir(_lora(), adapter)
    with pytest.raises(ValueError, match="peft adapter directory"):
        check_model_dir(_lora(rank=0), adapter)  # with LoRA off too: the loader's error would not say why


def test_all_linear_adapts_every_projection_but_the_head(tiny_model_dir, tiny_model):
    from hybrid_rl.models.lora import check_model_dir

    shapes = check_model_dir(_lora(), tiny_model_dir)
    layers = tiny_model.config.num_hidden_layers
    assert len(shapes) == 7 * layers and not any("lm_head" in n for n in shapes)
    assert check_model_dir(_lora(rank=0), tiny_model_dir) is None


# -- the adapted policy -------------------------------------------------------------------------
def test_base_frozen_adapters_fp32_over_a_bf16_base(tiny_model_dir):
    from hybrid_rl.models.lora import apply_lora, trainable_parameters

    model = _adapted(tiny_model_dir, _lora(target_modules=["q_proj", "v_proj"]), dtype=torch.bfloat16)
    train = {n for n, p in model.named_parameters() if p.requires_grad}
    assert train and all((".lora_A." in n or ".lora_B." in n) and ("q_proj" in n or "v_proj" in n) for n in train)
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if n in train else torch.bfloat16), n
    assert len(trainable_parameters(model)) == len(train) == 2 * 2 * model.config.num_hidden_layers
    assert apply_lora(model, _lora()) is model and len(trainable_parameters(model)) == len(train), "not idempotent"
    ids, attn, _, _ = batch()
    out = model(input_ids=ids, attention_mask=attn).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_optimizer_state_for_the_adapters_only_and_the_base_stays(tiny_model_dir):
    from hybrid_rl.models.lora import trainable_parameters

    model = _adapted(tiny_model_dir)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    ids, attn, mask, P = batch()
    model.train()
    loss = -(_logp_grad(model, ids, attn, P) * mask).sum()
    loss.backward()
    opt.step()
    adapters = {id(p) for p in trainable_parameters(model)}
    assert opt.state and set(map(id, opt.state)) == adapters
    for n, p in model.named_parameters():
        if n in base_before:
            assert p.grad is None and torch.equal(p, base_before[n]), f"{n} moved or got a gradient"


def _logp_grad(model, ids, attn, P):
    from hybrid_rl.models.logprobs import response_logprobs

    return response_logprobs(model, ids, attn, P, 1.0)[0]


# -- the reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_base_to_the_bit(tiny_model_dir, dtype):
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.lora import adapters_disabled

    policy = _adapted(tiny_model_dir, dtype=dtype)
    base = load_causal_lm(tiny_model_dir, dtype=dtype).eval()
    seq = batch()
    adapted = _logp(policy, seq)
    with adapters_disabled(policy) as ref:
        ref_logp = _logp(ref, seq)
        assert not any(p.requires_grad for p in policy.parameters()), "peft's switch clears the adapters' grads"
    assert torch.equal(ref_logp, _logp(base, seq)), "reference != the base model"
    assert (adapted - ref_logp).abs().max() > 1e-2, "the adapters must move the output for the test to mean anything"
    assert torch.equal(_logp(policy, seq), adapted), "adapters not back on after the reference"
    assert all(p.requires_grad == (".lora_" in n) for n, p in policy.named_parameters())


def test_reference_of_a_model_without_adapters_is_refused(tiny_model):
    from hybrid_rl.models.lora import adapters_disabled

    with pytest.raises(RuntimeError, match="without LoRA adapters"):
        with adapters_disabled(tiny_model):
            pass


# -- the adapter-only state ---------------------------------------------------------------------
def test_adapter_tensors_carry_peft_names_and_the_inference_dtype(tiny_model_dir):
    from peft import get_peft_model_state_dict

    from hybrid_rl.models.lora import adapter_named_tensors

    model = _adapted(tiny_model_dir)
    got = dict(adapter_named_tensors(model, torch.bfloat16))
    want = {f"base_model.model.{k}": v for k, v in get_peft_model_state_dict(model).items()}
    assert set(got) == set(want) and len(got) == 2 * 7 * model.config.num_hidden_layers
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("targets", [None, ("q_proj", "down_proj")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_bytes_equal_rank_times_in_plus_out_over_the_targets(tiny_model_dir, targets, dtype):
    from hybrid_rl.models.lora import adapter_bytes, adapter_named_tensors

    rank = 4
    settings = _lora(rank=rank) if targets is None else _lora(rank=rank, target_modules=list(targets))
    model = _adapted(tiny_model_dir, settings)
    want = expected_adapter_numel(model.config, rank, *(() if targets is None else (targets,))) * dtype.itemsize
    assert adapter_bytes(model, dtype) == want
    assert sum(t.numel() * t.element_size() for _, t in adapter_named_tensors(model, dtype)) == want


def test_base_parameters_carry_the_models_own_names_and_leave_the_adapters_out(tiny_model_dir, tiny_model):
    from hybrid_rl.models.lora import base_named_parameters

    got = dict(base_named_parameters(_adapted(tiny_model_dir)))
    want = dict(tiny_model.named_parameters())
    assert set(got) == set(want)
    for n, p in got.items():
        assert torch.equal(p, want[n]), n


def test_saved_adapter_directory_loads_back_in_peft(tiny_model_dir, tiny_model, tmp_path):
    from peft import PeftModel

    from hybrid_rl.models.lora import adapter_bytes, save_adapter_dir

    model = _adapted(tiny_model_dir)
    path = str(tmp_path / "adapter")
    assert save_adapter_dir(model, path) == adapter_bytes(model, torch.float32)
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["r"] == 8 and cfg["peft_type"] == "LORA"
    assert any(t.endswith("q_proj") for t in cfg["target_modules"]), cfg["target_modules"]
    loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model), path).eval()
    seq = batch()
    assert torch.equal(_logp(loaded, seq), _logp(model, seq))
