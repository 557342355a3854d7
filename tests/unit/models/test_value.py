"""The critic (hybrid_rl/models/value.py): a causal LM body with a scalar value head, and response_values.

Reference: the value before response token t is, by definition, the head on the last hidden state of
the body run on the unpadded prefix prompt + response[:t] alone; `naive_values` computes it one prefix
at a time. The tiny models are the session's HF directory (tests/conftest.py), loaded by the real code.

Legend: N sequences, P prompt columns, T response columns, L = P + T, H hidden size, V vocab.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_rl.models import value as value_module
from hybrid_rl.models.fsdp import prepare_policy
from hybrid_rl.models.logprobs import build_sequences, response_logprobs
from hybrid_rl.models.value import (
    VALUE_HEAD_FILE,
    ValueModel,
    load_value_model,
    packed_response_values,
    response_values,
    save_value_model,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# Lengths chosen so that no L equals the vocabulary size (15): the logits guard below reads the last dim.
PROMPTS = [[2, 4, 5], [2, 6], [2, 7, 8, 9, 4], [2]]
RESPONSES = [[5, 6, 7, 1], [8], [9, 4, 1], [6, 6, 6, 6, 6, 1]]


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Seeded noise on every matrix (as conftest's sharp_model): at its init scale the tiny body barely mixes
    tokens, so a value would hardly move if padding leaked into attention."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.15 * torch.randn(p.shape, generator=g))
    return model


def sharp_critic(tiny_model_dir, head_scale: float = 50.0, **load) -> ValueModel:
    model = sharpen(load_value_model(tiny_model_dir, **load))
    # A fresh head is small (std 0.02): scale it so values differ by more than the tolerances.
    with torch.no_grad():
        model.value_head.weight.mul_(head_scale)
        model.value_head.bias.fill_(0.3)
    return model


@pytest.fixture
def critic(tiny_model_dir) -> ValueModel:
    return sharp_critic(tiny_model_dir)


def naive_values(model: ValueModel, prompt: list[int], response: list[int]) -> list[float]:
    """V before each response token: the head on the body's last hidden state for each unpadded prefix."""
    out = []
    for t in range(len(response)):
        ids = torch.tensor([prompt + response[:t]])
        hidden_H = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
        out.append((hidden_H.float() @ model.value_head.weight[0].float() + model.value_head.bias[0]).item())
    return out


def _batch(prompts=PROMPTS, responses=RESPONSES, pad_id=0):
    return build_sequences(prompts, responses, pad_id)


# ---------------------------------------------------------------- alignment and padding
def test_values_match_the_naive_per_prefix_loop(critic):
    """Catches: off-by-one alignment (the value after token t, or two before), padding leaking into values."""
    ids, attn, mask, P = _batch()
    with torch.no_grad():
        values = response_values(critic, ids, attn, P)
    assert values.shape == mask.shape and values.dtype == torch.float32
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        want = torch.tensor(naive_values(critic, p, r))
        assert torch.allclose(values[i, : len(r)], want, atol=1e-5), (i, values[i], want)
    assert values[mask != 0].std() > 0.05, "values barely vary: the test could not see a shifted column"


def test_layout_is_response_logprobs_layout(critic, tiny_model, monkeypatch):
    """Column t of the values reads the hidden state whose logits score response token t in response_logprobs:
    with the same body, values == head(the rows response_logprobs hands its LM head), reshaped to (N, T).
    Catches: an off-by-one alignment against the log-probs' layout."""
    import hybrid_rl.models.logprobs as logprobs

    ids, attn, mask, P = _batch()
    seen = []
    real = logprobs.chunked_logprob_entropy
    monkeypatch.setattr(
        logprobs,
        "chunked_logprob_entropy",
        lambda hidden_RH, *a, **k: seen.append(hidden_RH) or real(hidden_RH, *a, **k),
    )
    with torch.no_grad():
        critic.model.load_state_dict(tiny_model.model.state_dict())  # same body, so the same hidden states
        response_logprobs(tiny_model, ids, attn, P)
        values = response_values(critic, ids, attn, P)
    (hidden_RH,) = seen
    head = critic.value_head
    want = (hidden_RH.float() @ head.weight[0].float() + head.bias[0]).view(mask.shape)
    valid = mask != 0
    assert torch.allclose(values[valid], want[valid], atol=1e-5)


def test_left_padding_does_not_change_values(critic):
    """Catches: positions or attention that count the padding (position_ids or attention_mask not passed)."""
    ids, attn, mask, P = _batch()
    extra = 3
    ids_pad = torch.cat([torch.zeros(ids.shape[0], extra, dtype=ids.dtype), ids], dim=1)
    attn_pad = torch.cat([torch.zeros(ids.shape[0], extra, dtype=attn.dtype), attn], dim=1)
    with torch.no_grad():
        values = response_values(critic, ids, attn, P)
        padded = response_values(critic, ids_pad, attn_pad, P + extra)
        alone = [response_values(critic, *_batch([p], [r])[:2], len(p)) for p, r in zip(PROMPTS, RESPONSES)]
    valid = mask != 0
    assert torch.allclose(padded[valid], values[valid], atol=1e-5)
    for i, r in enumerate(RESPONSES):
        assert torch.allclose(alone[i][0, : len(r)], values[i, : len(r)], atol=1e-5)


# ---------------------------------------------------------------- packed / padding-free (the actor's layouts)
# The fresh head's scale: values of a few units (std ~1.3 here), so an atol of 1e-5 is fp32's summation order at
# most; at 50x (the fixture's) they reach ~150 and differ by ~1e-4 between layouts from rounding alone.
PACKED_HEAD_SCALE = 1.0


def _grouped_batch(groups: int = 5, G: int = 3, seed: int = 0):
    """GRPO-shaped rows: `groups` prompts of 1-5 tokens, G samples each (so the shared layout shares them),
    responses of 1-9 tokens, one empty and one at the maximum; ids 3..14."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 15) for _ in range(rng.randint(1, 5))] for _ in range(groups)]
    responses = [[rng.randrange(3, 15) for _ in range(rng.randint(1, 9))] for _ in range(groups * G)]
    responses[1], responses[2] = [], [7] * 9
    ids, attn, mask, P = build_sequences([p for p in prompts for _ in range(G)], responses, pad_id=0)
    return ids, attn, mask.float(), P


def _padded_reference(model, ids, attn, mask, P):
    """The padded path's values (pinned to the naive per-prefix loop by test_values_match_the_naive_per_prefix_loop)
    and the gradients of their masked sum, then the model's grads cleared."""
    values = response_values(model, ids, attn, P)
    (values * mask * torch.linspace(0.5, 1.5, mask.shape[1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return values * mask, grads


def _assert_same_gradients(model, want_grads: dict) -> None:
    """Every parameter's gradient within 1e-5 relative in norm of the padded path's (CONTRIBUTING's rule)."""
    for n, p in model.named_parameters():
        rel = float((p.grad - want_grads[n]).norm() / want_grads[n].norm().clamp(min=1e-12))
        assert rel <= 1e-5, f"grad {n}: relative difference {rel:.2e} in norm"


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", ["rows", "one_row", "shared"])
def test_packed_values_and_gradients_equal_the_padded_path(tiny_model_dir, monkeypatch, attn_impl, layout):
    """packed_response_values (the actor's packed layouts: first-fit-decreasing rows; one_row, the layout
    flash-attention varlen gets, run here through the block-diagonal mask; shared, each distinct prompt once) gives
    the padded values to 1e-5 and every parameter's gradient. A comparison of two library paths: the padded one is
    pinned by test_values_match_the_naive_per_prefix_loop and test_left_padding_does_not_change_values.
    Catches: wrong position ids in a packed layout (sequences of a row attending to each other, or a response at
    another distance from its prompt), the head read at the slot after (or before) the state, values scattered
    to the wrong (row, column), padding not 0."""
    if layout == "one_row":
        monkeypatch.setattr(value_module, "attention_implementation", lambda model: "flash_attention_2")
    model = sharp_critic(tiny_model_dir, PACKED_HEAD_SCALE, attn_implementation=attn_impl)
    ids, attn, mask, P = _grouped_batch()
    want, want_grads = _padded_reference(model, ids, attn, mask, P)

    got = packed_response_values(model, ids, attn, P, min_saving=0.0, share_prompts=layout == "shared")
    assert got.shape == mask.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not got[mask == 0].any(), "padding reads 0"
    assert want[mask != 0].std() > 0.05, "values barely vary: the test could not see a shifted slot"
    (got * mask * torch.linspace(0.5, 1.5, mask.shape[1])).sum().backward()
    _assert_same_gradients(model, want_grads)


def test_shared_prefix_values_run_each_prompt_once_and_checkpoint(tiny_model_dir):
    """The default layout for a supported model is the distinct-token row (what the actor's packed forward runs),
    and under gradient checkpointing (train mode) the recomputed layers get the layout again: the gradients
    are the padded path's. Catches: the critic falling back to packed rows or padding where the actor shares
    prompts (twice its forward), the layout lost in the recompute."""
    model = prepare_policy(sharp_critic(tiny_model_dir, PACKED_HEAD_SCALE), gradient_checkpointing=True).train()
    ids, attn, mask, P = _grouped_batch()
    want, want_grads = _padded_reference(model, ids, attn, mask, P)
    fed = []
    hook = model.model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].shape), with_kwargs=True)
    got = packed_response_values(model, ids, attn, P)
    hook.remove()
    G = 3  # _grouped_batch's samples per prompt
    distinct = int(attn[::G, :P].sum()) + int((attn[:, P:].sum(1) - 1).clamp(min=0).sum())
    assert fed == [torch.Size([1, distinct])], f"fed {fed}, want one row of {distinct} distinct tokens"
    assert distinct < int(attn.sum()) < ids.numel(), "fewer tokens than packed rows, fewer than padding"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    (got * mask * torch.linspace(0.5, 1.5, mask.shape[1])).sum().backward()
    _assert_same_gradients(model, want_grads)


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("similar", [False, True])
def test_packed_values_fall_back_to_padded_when_packing_saves_little(
    tiny_model_dir, monkeypatch, similar, share_prompts
):
    """As the actor's packed_response_logprobs: three sequences too long to share a row (15, 14, 15 tokens in rows
    of 15), distinct prompts, so neither layout saves 10% of the slots and the padded forward runs, its padding
    set to 0; otherwise the packed one. Catches: a layout that costs more than padding, garbage at padding."""
    critic = sharp_critic(tiny_model_dir, PACKED_HEAD_SCALE)
    if similar:
        responses = [[7, 8] * 6, [10] * 11, [3, 3, 4] * 4]
        ids, attn, mask, P = build_sequences([[5, 6, 7], [8, 9, 4], [5, 5, 5]], responses, pad_id=0)
    else:
        ids, attn, mask, P = _grouped_batch()
    padded_calls = []
    real = value_module.response_values
    monkeypatch.setattr(value_module, "response_values", lambda *a, **k: padded_calls.append(1) or real(*a, **k))
    with torch.no_grad():
        got = packed_response_values(critic, ids, attn, P, share_prompts=share_prompts)
        want = real(critic, ids, attn, P) * mask
    assert len(padded_calls) == (1 if similar else 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not got[mask == 0].any()


def test_no_lm_head_is_loaded_or_computed(critic, tiny_model_dir):
    """Catches: a critic built on the causal LM (its lm_head computing (N, L, V) logits), even when tied."""
    vocab = critic.config.vocab_size
    ids, attn, _, P = _batch()
    assert vocab not in (ids.shape[1], ids.shape[0])
    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor):
                    shapes.append((str(func), tuple(o.shape)))
            return out

    with Shapes():
        response_values(critic, ids, attn, P).sum().backward()
    assert shapes, "the dispatch mode saw nothing"
    logits = [s for s in shapes if s[1] and s[1][-1] == vocab and len(s[1]) >= 2 and s[1][0] != vocab]
    assert not logits, f"something computed vocabulary-sized outputs: {logits[:3]}"
    names = [n for n, _ in critic.named_parameters()]
    assert not any("lm_head" in n for n in names)
    assert set(n.split(".")[0] for n in names) == {"model", "value_head"}


def test_untied_checkpoint_leaves_the_lm_head_unread(tmp_path):
    """A policy with its own lm_head.weight: the critic holds the body and the value head only, and the unread
    head raises no warning. Catches: a critic built on the causal LM (its lm_head loaded)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=17,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg)
    lm.save_pretrained(tmp_path / "untied")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the unread lm_head.weight is expected: no warning for it
        critic = load_value_model(str(tmp_path / "untied"))
    n_body = sum(p.numel() for p in lm.model.parameters())
    assert sum(p.numel() for p in critic.parameters()) == n_body + 32 + 1
    for k, v in lm.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[k], v), k


# ---------------------------------------------------------------- training
def test_gradient_reaches_head_and_body(critic):
    """Catches: a detached body (only the head trains) or a head outside the graph."""
    ids, attn, mask, P = _batch()
    critic.train()
    values = response_values(critic, ids, attn, P)
    (values * mask).sum().backward()
    for name in (
        "value_head.weight",
        "value_head.bias",
        "model.layers.0.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        grad = dict(critic.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    # The bias gradient is the number of summed values: every valid column, nothing else.
    assert critic.value_head.bias.grad.item() == pytest.approx(float(mask.sum()))


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    """prepare_policy switches checkpointing on through ValueModel; the recompute changes no gradient."""
    ids, attn, mask, P = _batch()
    grads = []
    for checkpointing in (False, True):
        model = prepare_policy(load_value_model(tiny_model_dir), checkpointing)
        assert model.is_gradient_checkpointing == checkpointing
        model.train()
        calls = []
        layer = model.model.layers[0].mlp
        layer.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
        (response_values(model, ids, attn, P) * mask).sum().backward()
        assert len(calls) == (2 if checkpointing else 1), "the layer was not recomputed in the backward"
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-7), name


# ---------------------------------------------------------------- fresh head, save and load
def test_fresh_head_is_seeded_and_leaves_the_global_rng_alone(tiny_model_dir):
    """Catches: a fresh head drawn from the global RNG (a critic would shift the policy's sampling stream)."""
    before = torch.get_rng_state()
    a, b = load_value_model(tiny_model_dir), load_value_model(tiny_model_dir)
    assert torch.equal(torch.get_rng_state(), before), "building the critic moved the global RNG"
    c = load_value_model(tiny_model_dir, seed=1)
    assert torch.equal(a.value_head.weight, b.value_head.weight)
    assert not torch.equal(a.value_head.weight, c.value_head.weight)
    std = a.value_head.weight.std().item()
    assert 0.01 < std < 0.03 and torch.equal(a.value_head.bias, torch.zeros(1))  # transformers' init, std 0.02


def test_save_and_load_round_trip(critic, tiny_model_dir, tiny_tokenizer, tmp_path):
    """Catches: a saved head that is not read back (a fresh one instead), a body saved under the wrong keys."""
    with torch.no_grad():
        critic.model.layers[1].mlp.up_proj.weight.add_(0.01)  # a trained body differs from the policy's
    out = save_value_model(critic, str(tmp_path / "critic"), tiny_tokenizer)
    assert os.path.isfile(os.path.join(out, VALUE_HEAD_FILE)) and os.path.isfile(os.path.join(out, "tokenizer.json"))
    back = load_value_model(out)
    assert back.state_dict().keys() == critic.state_dict().keys()
    for k, v in critic.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ids, attn, _, P = _batch()
    with torch.no_grad():
        assert torch.equal(response_values(back, ids, attn, P), response_values(critic, ids, attn, P))
    # The policy's own directory beside it is untouched and still gives a fresh head.
    assert not os.path.exists(os.path.join(tiny_model_dir, VALUE_HEAD_FILE))


def _with_head(src, dst, **tensors):
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file(tensors, os.path.join(dst, VALUE_HEAD_FILE))
    return str(dst)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda src, tmp: str(tmp / "missing"), FileNotFoundError, "does not exist"),
        (lambda src, tmp: (tmp / "empty").mkdir() or str(tmp / "empty"), FileNotFoundError, "no config.json"),
        (
            lambda src, tmp: (
                _with_head(src, tmp / "w", weight=torch.zeros(1, 64), bias=torch.zeros(1))
                and os.remove(tmp / "w" / "model.safetensors")
                or str(tmp / "w")
            ),
            FileNotFoundError,
            "no \\*.safetensors weights besides value_head.safetensors",
        ),
        (
            lambda src, tmp: _with_head(src, tmp / "h", weight=torch.zeros(1, 32), bias=torch.zeros(1)),
            ValueError,
            "value_head.safetensors holds a value head for hidden size 32 .* has hidden size 64",
        ),
        (
            lambda src, tmp: _with_head(src, tmp / "k", weight=torch.zeros(1, 64)),
            ValueError,
            "value_head.safetensors must hold exactly the tensors 'weight' and 'bias'",
        ),
        (
            lambda src, tmp: _with_head(src, tmp / "n", weight=torch.full((1, 64), float("nan")), bias=torch.zeros(1)),
            ValueError,
            "value_head.safetensors holds NaN or inf",
        ),
    ],
)
def test_bad_directories_are_refused_naming_the_file(tiny_model_dir, tmp_path, make, error, match):
    """Catches: a dropped hidden-size check (torch's copy error then names no file), a NaN head loaded."""
    path = make(tiny_model_dir, tmp_path)
    with pytest.raises(error, match=match):
        load_value_model(path)


def _more_layers(src, dst):
    shutil.copytree(src, dst)
    cfg = json.load(open(dst / "config.json"))
    cfg["num_hidden_layers"] += 1
    cfg.pop("layer_types", None)
    json.dump(cfg, open(dst / "config.json", "w"))
    return str(dst)


def test_weights_missing_from_the_checkpoint_are_refused(tiny_model_dir, tmp_path):
    """A config that asks for a layer the safetensors lack: transformers would initialise it at random.
    Catches: the missing-key check dropped."""
    with pytest.raises(ValueError, match="lacks 12 weights .*layers.2"):
        load_value_model(_more_layers(tiny_model_dir, tmp_path / "more"))


def test_tensors_other_than_the_lm_head_left_unread_are_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "extra"
    shutil.copytree(tiny_model_dir, dst)
    state = load_file(dst / "model.safetensors")
    state["score.weight"] = torch.zeros(1, 64)  # e.g. a token-classification head of another library
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="1 tensors not read .*score.weight"):
        load_value_model(str(dst))


def test_bad_layout_and_model(critic):
    ids, attn, _, P = _batch()
    with pytest.raises(ValueError, match="must be the same \\(N, L\\)"):
        response_values(critic, ids, attn[:, 1:], P)
    with pytest.raises(ValueError, match="need P >= 1 prompt and T >= 1 response"):
        response_values(critic, ids, attn, ids.shape[1])
    with pytest.raises(TypeError, match="needs a ValueModel"):
        save_value_model(torch.nn.Linear(2, 1), "/nonexistent")
    with pytest.raises(ValueError, match="nn.Linear\\(64, 1\\)"):
        ValueModel(critic.model, torch.nn.Linear(32, 1))
