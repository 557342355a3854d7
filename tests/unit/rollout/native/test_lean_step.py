"""The lean decode step (`rollout/native/lean_step.py`) against the model's own forward, per architecture.

Each supported family is built in code with the parts that change its attention: Qwen2's
q/k/v bias, Llama without bias and with llama3 rope scaling, Qwen3's per-head q/k norms,
multi-head (G = 1) and grouped (G = 2, 4) attention. The same seeded rollout through the
lean step and through the forward must give the same tokens and logprobs equal within 1e-5;
the logprobs equal the trainer's; unsupported models fall back to the forward.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hybrid_rl.models.logprobs import build_sequences, response_logprobs
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.rollout.native.kv_cache import StaticKVCache
from hybrid_rl.rollout.native.lean_step import LeanStep, unsupported_reason
from hybrid_rl.types import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAD, EOS, V = 0, 1, 24
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14], [9, 9, 14]]
MANY = [p for p in PROMPTS for _ in range(3)]
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=64,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=2,
)


def _sharpen(model, seed=0):
    """Seeded noise on every matrix: outputs depend on the context and EOS comes now and then."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def _build(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2_gqa":
        cfg = transformers.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    elif kind == "qwen2_mha":
        cfg = transformers.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=4)
    elif kind == "llama_rope_scaled":
        cfg = transformers.LlamaConfig(
            **COMMON,
            num_attention_heads=8,
            num_key_value_heads=2,
            attention_bias=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        raise KeyError(kind)
    return _sharpen(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))


KINDS = ["qwen2_gqa", "qwen2_mha", "llama_rope_scaled", "qwen3"]


@pytest.mark.parametrize("kind", KINDS)
def test_lean_rollout_equals_forward_rollout_and_the_trainer(kind):
    model = _build(kind)
    assert unsupported_reason(model) is None
    sp = SamplingParams(max_new_tokens=10, temperature=0.9, seed=3, stop_token_ids=(4, 7))
    lean_eng = NativeEngine(model, PAD, EOS, lean_step=True)
    lean = lean_eng.generate(MANY, sp)
    fwd_eng = NativeEngine(model, PAD, EOS, lean_step=False)
    fwd = fwd_eng.generate(MANY, sp)
    assert (lean_eng.last_decode_path, fwd_eng.last_decode_path) == ("lean", "forward")
    lengths = [len(c.token_ids) for c in lean]
    assert len(set(lengths)) > 2, "rows stop at different steps: compaction is covered"
    for i, (a, b) in enumerate(zip(lean, fwd)):
        assert a.token_ids == b.token_ids, f"row {i}"
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    ids, attn, _, P = build_sequences(MANY, [c.token_ids for c in lean], PAD)
    with torch.no_grad():
        logp_NT, _ = response_logprobs(model, ids, attn, P, sp.temperature)
    for i, c in enumerate(lean):
        torch.testing.assert_close(torch.tensor(c.logprobs), logp_NT[i, : len(c.logprobs)], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2_gqa", "qwen3"])
def test_lean_greedy_equals_full_forward_argmax(kind):
    model = _build(kind)
    comps = NativeEngine(model, PAD, EOS, lean_step=True).generate(
        PROMPTS, SamplingParams(max_new_tokens=8, greedy=True)
    )
    for p, c in zip(PROMPTS, comps):
        seq = list(p)
        for tok in c.token_ids:
            with torch.no_grad():
                assert model(input_ids=torch.tensor([seq])).logits[0, -1].argmax().item() == tok
            seq.append(tok)


def test_one_step_logits_equal_the_forward_step():
    """The step itself, on a cache with left-padded rows: logits of the lean step = the HF forward's."""
    model = _build("qwen2_gqa")
    from hybrid_rl.models.logprobs import left_pad, position_ids

    ids, attn = left_pad(PROMPTS, PAD, torch.device("cpu"))
    N, P = ids.shape
    caches, logits = [], []
    for lean in (False, True):
        cache = StaticKVCache(N, P + 2)
        with torch.no_grad():
            model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=position_ids(attn),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache.advance(P)
            tok = torch.tensor([[3], [4], [5], [6]])
            pos = position_ids(attn)[:, -1:] + 1
            mask = torch.cat([attn.bool(), torch.ones(N, 1, dtype=torch.bool)], 1)
            if lean:
                out = LeanStep.build(model)(tok, pos, mask, cache)
            else:
                out = model(
                    input_ids=tok,
                    attention_mask=mask[:, None, None, :],
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                ).logits[:, -1]
            cache.advance(1)
        caches.append(cache)
        logits.append(out)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
    for a, b in zip(caches[0].layers, caches[1].layers):  # the new token's key and value land in the same slot
        torch.testing.assert_close(b.keys[:, :, : P + 1], a.keys[:, :, : P + 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(b.values[:, :, : P + 1], a.values[:, :, : P + 1], atol=1e-5, rtol=0)


def test_step_rejects_a_mask_of_the_wrong_width():
    model = _build("qwen2_gqa")
    cache = StaticKVCache(2, 6)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6], [7, 8]]), past_key_values=cache, use_cache=True)
    cache.advance(2)
    with pytest.raises(ValueError, match="mask"):
        LeanStep.build(model)(
            torch.tensor([[3], [4]]), torch.tensor([[2], [2]]), torch.ones(2, 2, dtype=torch.bool), cache
        )


def unsupported_models():
    """A Mistral with a sliding window and a GPT-2: what the Llama-family fast paths must refuse."""
    mistral = transformers.MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    gpt2 = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    return (
        _sharpen(transformers.AutoModelForCausalLM.from_config(mistral, dtype=torch.float32)),
        transformers.GPT2LMHeadModel(gpt2),
    )


def test_unsupported_models_decode_through_the_forward():
    model, gpt2 = unsupported_models()
    assert "sliding" in unsupported_reason(model)
    assert "model_type" in unsupported_reason(gpt2)
    eng = NativeEngine(model, PAD, EOS, lean_step=True)
    with pytest.warns(UserWarning, match="lean_step=True ignored: .*sliding"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))
    assert eng.last_decode_path == "forward"
    eng = NativeEngine(model, PAD, EOS)  # default: no warning, the forward
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))
    assert eng.last_decode_path == "forward"
