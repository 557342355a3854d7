"""The chunked LM head under FSDP2 over 2 gloo ranks equals the unfused path on one plain model.

The head runs inside the root module's forward (models/logprobs.py), where FSDP2 has
all-gathered the root's parameters (embed_tokens, the final norm, lm_head); its
gradient goes to the unsharded parameter and FSDP2 reduce-scatters it. Checked here
for a tied model (the head's weight is embed_tokens') and an untied one with a larger
vocabulary: logp, entropy and the full gradient of every parameter, for a loss that
uses both logp and entropy, with each rank on its own rows. In fp32 the match is to
fp32 rounding; with bf16 mixed precision (bf16 unsharded weights, the chunk's softmax
in fp32) to bf16 rounding.

Legend: N sequences, P prompt tokens, T response tokens, L = P + T, V vocab.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow

ROWS = 8  # global batch; rank r scores rows [4r, 4r + 4)
CHUNKS = (3, None)  # a chunk that splits rows mid-sequence, and the default (one chunk here)
PRECISIONS = ("fp32", "bf16")


def _batch(vocab: int):
    """Prompts of 1..4 tokens, responses of 0..6 tokens, and per-token loss coefficients."""
    from hybrid_rl.models.logprobs import build_sequences

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (1 + i % 4,), generator=g).tolist() for i in range(ROWS)]
    responses = [torch.randint(3, vocab, ((i * 5) % 7,), generator=g).tolist() for i in range(ROWS)]
    ids, attn, mask, P = build_sequences(prompts, responses, pad_id=0)
    a = torch.randn(mask.shape, generator=g) * mask
    b = torch.randn(mask.shape, generator=g) * mask
    return ids, attn, P, a, b


def _loss(lp: torch.Tensor, ent: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * lp + b * ent).sum()


def _rank_fn(rank: int, model_dirs: dict[str, str]):
    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.logprobs import response_logprobs
    from hybrid_rl.runtime import distributed as D

    dev = D.init("cpu", timeout_s=60)
    torch.manual_seed(0)
    rows = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
    out = {}
    for (name, path), prec in itertools.product(model_dirs.items(), PRECISIONS):
        model = shard_model(load_causal_lm(path), dev, mixed_precision=prec == "bf16")
        ids, attn, P, a, b = _batch(model.config.vocab_size)
        for chunk in CHUNKS:
            # A no-grad scoring pass first, as the trainer does, then the training pass.
            with torch.no_grad():
                lp0, _ = response_logprobs(model, ids[rows], attn[rows], P, 0.7, chunk_tokens=chunk)
            lp, ent = response_logprobs(model, ids[rows], attn[rows], P, 0.7, chunk_tokens=chunk)
            _loss(lp, ent, a[rows], b[rows]).backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            out[(name, prec, chunk)] = {"logp0": lp0, "logp": lp.detach(), "entropy": ent.detach(), "grads": grads}
    return out


def _reference(path: str):
    """Unfused on one plain model: full logits, log_softmax, gather, entropy; rank losses averaged."""
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.logprobs import position_ids

    model = load_causal_lm(path)
    ids, attn, P, a, b = _batch(model.config.vocab_size)
    N, L = ids.shape
    T = L - P
    logits = (
        model(
            input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False, logits_to_keep=T + 1
        )
        .logits[:, :-1]
        .float()
        / 0.7
    )
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, ids[:, P:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    # FSDP2 averages gradients over ranks: the global loss is the mean of the rank losses.
    half = ROWS // 2
    (
        0.5 * (_loss(lp[:half], ent[:half], a[:half], b[:half]) + _loss(lp[half:], ent[half:], a[half:], b[half:]))
    ).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return lp.detach(), ent.detach(), grads, tied


def _untied_model_dir(path: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, prec: str, grad: bool = False) -> None:
    if prec == "fp32":
        torch.testing.assert_close(
            actual, expected, atol=1e-5, rtol=1e-4 if grad else 1e-5, msg=lambda m: f"{what}: {m}"
        )
        return
    # bf16 weights and activations: a few parts in a thousand per element; gradients
    # compared as a whole (relative norm) since single small entries carry bf16 noise.
    assert actual.dtype == expected.dtype, what
    err = ((actual - expected).norm() / expected.norm().clamp(min=1e-12)).item()
    assert err < (3e-2 if grad else 1e-2), f"{what}: relative error {err:.3g}"


def test_two_rank_chunked_logprobs_match_unfused(tiny_model_dir, tmp_path):
    dirs = {"tied-tiny": tiny_model_dir, "untied-v1000": _untied_model_dir(str(tmp_path / "untied"))}
    per_rank = run_ranks(_rank_fn, world=2, args=(dirs,))
    half = ROWS // 2
    for name, path in dirs.items():
        lp_ref, ent_ref, grads_ref, tied = _reference(path)
        assert tied == (name == "tied-tiny")
        for prec, chunk, rank in itertools.product(PRECISIONS, CHUNKS, range(2)):
            r = per_rank[rank][(name, prec, chunk)]
            rows = slice(rank * half, (rank + 1) * half)
            what = f"{name} {prec} chunk={chunk} rank {rank}"
            _close(r["logp0"], lp_ref[rows], f"{what} no-grad logp", prec)
            _close(r["logp"], lp_ref[rows], f"{what} logp", prec)
            _close(r["entropy"], ent_ref[rows], f"{what} entropy", prec)
            assert set(r["grads"]) == set(grads_ref), what
            for n, g_ref in grads_ref.items():
                _close(r["grads"][n], g_ref, f"{what} grad {n}", prec, grad=True)
