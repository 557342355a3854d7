"""The distinct-token layout (models/shared_prefix.py) against the padded path.

A GRPO micro-batch: a few prompts of different lengths (left-padded), each with several
samples of different lengths (an empty one included). Run as one row of distinct tokens,
the log-probs, entropies and the gradients of every parameter must equal the padded
layout's, on each supported family (Qwen2 GQA and MHA, Llama with rope scaling, Qwen3);
each prompt is computed once; forwards without the layout are untouched by the install.
Legend: N sequences, P prompt columns, T response columns, K distinct tokens.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.models import shared_prefix
from hybrid_rl.models.logprobs import build_sequences, position_ids, response_logprobs
from hybrid_rl.models.packing import packed_response_logprobs
from hybrid_rl.models.shared_prefix import build_layout, install, shared_prefix_logprobs, unsupported_reason
from tests.unit.rollout.native.test_lean_step import KINDS, _build, unsupported_models

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14]]
RESPONSES = [[3, 4, 1], [9], [4, 4, 4, 4, 4, 4, 4, 4], [], [7, 7], [20, 21, 22, 1], [3], [5, 6], [10, 11, 12, 13, 1]]


def _group_batch():
    """3 prompts x 3 samples, rows grouped by prompt as the trainer lays them out."""
    prompts = [p for p in PROMPTS for _ in range(3)]
    ids, attn, mask, P = build_sequences(prompts, RESPONSES, pad_id=0)
    return ids, attn, mask.float(), P


def _assert_grads_close(model, ref_g: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    """Each parameter's gradient within `rel` of the reference in norm: fp32 summation order moves single
    elements of a sum over many tokens by ~1e-5, a wrong mask or gather moves the whole gradient by O(1)."""
    for n, p in model.named_parameters():
        err = ((p.grad - ref_g[n]).norm() / ref_g[n].norm()).item()
        assert err < rel, f"grad {n}: relative error {err:.2e}"


# The tokens the model runs on: each distinct prompt once, each response without its last token.
DISTINCT_TOKENS = sum(map(len, PROMPTS)) + sum(max(len(r) - 1, 0) for r in RESPONSES)


def test_layout_of_a_grouped_batch():
    ids, attn, _, P = _group_batch()
    lay = build_layout(ids, attn, P)
    assert lay.prompts == 3
    assert lay.tokens == DISTINCT_TOKENS
    Ti = max(map(len, RESPONSES)) - 1
    assert lay.gather_NL.shape == (9, P + Ti)
    # The fed slots: every real prompt token, every response token but a row's last.
    real = attn.bool()[:, : P + Ti].clone()
    for n, r in enumerate(RESPONSES):
        real[n, P + max(len(r) - 1, 0) :] = False
    # Every fed slot reads the distinct token with its id and position; each distinct token has one owner.
    assert torch.equal(lay.ids_1K[0][lay.gather_NL[real]], ids[:, : P + Ti][real])
    assert torch.equal(lay.pos_1K[0][lay.gather_NL[real]], position_ids(attn)[:, : P + Ti][real])
    assert torch.equal(lay.gather_NL[real].unique(), torch.arange(lay.tokens))
    # Each distinct token takes its attention output from a query slot of one of the two parts that holds it.
    query_slots = torch.cat([lay.prompt.gather_q.reshape(-1), lay.response.gather_q.reshape(-1)])
    assert torch.equal(query_slots[lay.owner_K], torch.arange(lay.tokens))
    assert lay.prompt.gather_q.shape == (3, P) and lay.response.gather_q.shape == (9, Ti)
    # The G samples of a prompt read the same distinct prompt tokens.
    for u in range(3):
        rows = lay.gather_NL[3 * u : 3 * u + 3, :P]
        assert (rows == rows[0]).all()
    # Response token q is predicted by the slot before it: the prompt's last token for the first one.
    n, t = lay.row_Q, lay.col_Q
    assert torch.equal(lay.target_Q, ids[n, P + t])
    assert torch.equal(lay.pred_Q, lay.gather_NL[n, P + t - 1])


@pytest.mark.parametrize("attention", ["small", "sdpa"])
@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_entropy_and_gradients_equal_the_padded_path(kind, attention, monkeypatch):
    """small: the batched-product attention of short rows; sdpa: the base kernel that long rows use."""
    if attention == "sdpa":
        monkeypatch.setattr(shared_prefix, "SMALL_ATTENTION_MAX_LEN", 0)
    check_equals_the_padded_path(_build(kind))


def check_equals_the_padded_path(model) -> None:
    """Shared-prefix log-probs, entropies and gradients against the padded path's, on the model's device."""
    dev = next(model.parameters()).device
    ids, attn, mask, P = (t.to(dev) if isinstance(t, torch.Tensor) else t for t in _group_batch())
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).to(dev) * mask
    ref_lp, ref_ent = response_logprobs(model, ids, attn, P, temperature=0.7)
    ((ref_lp * w).sum() + (ref_ent * w).sum()).backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    lp, ent = shared_prefix_logprobs(model, ids, attn, P, temperature=0.7)
    torch.testing.assert_close(lp, ref_lp * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent * mask, rtol=1e-5, atol=1e-5)
    assert not lp[mask == 0].any() and not ent[mask == 0].any(), "padding reads 0"
    ((lp * w).sum() + (ent * w).sum()).backward()
    _assert_grads_close(model, ref_g)


def test_the_micro_batch_forward_runs_each_prompt_once():
    """packed_response_logprobs picks the layout for a supported model; the model sees K distinct tokens."""
    model = _build("qwen2_gqa")
    ids, attn, _, P = _group_batch()
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    with torch.no_grad():
        packed_response_logprobs(model, ids, attn, P, min_saving=0.0)
    assert seen == [torch.Size([1, DISTINCT_TOKENS])]


def test_other_forwards_run_the_base_attention_after_install():
    model = _build("qwen2_gqa")
    ids, attn, _, _ = _group_batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn)).logits
        install(model)
        install(model)  # idempotent
        assert model.config._attn_implementation == "hybrid_rl_shared_prefix+sdpa"
        after = model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn)).logits
    assert torch.equal(before, after)
    assert unsupported_reason(model) is None


def test_unsupported_models_use_packed_rows():
    model, gpt2 = unsupported_models()
    assert "sliding" in unsupported_reason(model)
    assert "model_type" in unsupported_reason(gpt2)
    ids, attn, mask, P = _group_batch()
    with torch.no_grad():
        lp, _ = packed_response_logprobs(model, ids, attn, P, min_saving=0.0)
        ref, _ = response_logprobs(model, ids, attn, P)
    torch.testing.assert_close(lp, ref * mask, rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="sliding"):
        shared_prefix_logprobs(model, ids, attn, P)


def test_one_token_answers_feed_the_prompts_only():
    """Every answer a single token (or none): no response column is fed, the prompts predict them all."""
    model = _build("qwen2_gqa")
    prompts = [p for p in PROMPTS for _ in range(2)]
    ids, attn, mask, P = build_sequences(prompts, [[3], [1], [], [9], [4], [1]], pad_id=0)
    lay = build_layout(ids, attn, P)
    assert lay.tokens == sum(map(len, PROMPTS)) and lay.response.gather_q.shape == (6, 0)
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    ref_lp, _ = response_logprobs(model, ids, attn, P)
    (ref_lp * w).sum().backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, _ = shared_prefix_logprobs(model, ids, attn, P)
    torch.testing.assert_close(lp, ref_lp * mask, rtol=1e-5, atol=1e-5)
    (lp * w).sum().backward()
    _assert_grads_close(model, ref_g)


def test_a_row_without_prompt_tokens_is_refused():
    ids, attn, _, P = _group_batch()
    attn[0, :P] = 0
    with pytest.raises(ValueError, match="prompt token"):
        build_layout(ids, attn, P)


def test_the_masks_are_the_padded_layouts_and_padding_queries_see_every_key():
    """A fully masked query row would make NaN in the attention; its output is discarded anyway."""
    ids, attn, _, P = _group_batch()
    lay = build_layout(ids, attn, P)
    real, L = attn.bool(), ids.shape[1]
    causal_LL = torch.ones(L, L, dtype=torch.bool).tril()
    full_NLL = causal_LL[None] & real[:, None, :]  # the padded layout's mask, query x key
    Li = lay.gather_NL.shape[1]
    fed = real[:, :Li].clone()
    for n, r in enumerate(RESPONSES):
        fed[n, P + max(len(r) - 1, 0) :] = False  # a row's last token is never a query or a key
    resp = lay.response.mask[:, 0]  # (N, Ti, P + Ti)
    assert resp.any(-1).all()
    assert torch.equal(resp[fed[:, P:]], full_NLL[:, P:Li, :Li][fed[:, P:]])
    prompt = lay.prompt.mask[:, 0]  # (U, P, P)
    assert prompt.any(-1).all()
    rep = [0, 3, 6]
    assert torch.equal(prompt[real[rep, :P]], full_NLL[rep, :P, :P][real[rep, :P]])
    assert shared_prefix.SUPPORTED == ("llama", "mistral", "qwen2", "qwen3")


def test_activation_checkpointing_recomputes_the_shared_attention():
    """A checkpointed layer re-runs its attention in the backward, outside the forward's context."""
    model = _build("qwen2_gqa").train()
    model.gradient_checkpointing_enable()
    ids, attn, mask, P = _group_batch()
    ref_lp, _ = response_logprobs(model, ids, attn, P)
    (ref_lp * mask).sum().backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, _ = shared_prefix_logprobs(model, ids, attn, P)
    lp.sum().backward()
    _assert_grads_close(model, ref_g)


def test_the_attention_modules_own_scaling_is_used():
    """Supported configs all scale by head_dim ** -0.5; a module that says otherwise must be obeyed."""
    model = _build("qwen2_gqa")
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.9
    ids, attn, mask, P = _group_batch()
    with torch.no_grad():
        ref, _ = response_logprobs(model, ids, attn, P)
        lp, _ = shared_prefix_logprobs(model, ids, attn, P)
    torch.testing.assert_close(lp, ref * mask, rtol=1e-5, atol=1e-5)
