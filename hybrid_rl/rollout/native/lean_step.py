"""The native engine's one-token decode step without the Hugging Face forward's plumbing.

A decode step of a small model is mostly overhead: transformers' generic forward
builds a mask, goes through the cache API, repeats the KV heads for GQA, wraps
every layer in hooks and output records, and only then runs the few matrix
products that are the real work (on 2 CPU cores at hidden 128 the HF step took
several times the arithmetic). `LeanStep` runs the same computation directly on the
model's own modules and parameters:

* embeddings, norms, the MLP, the final norm, the LM head and the rotary table are the
  model's modules, called as they are (so their variants need nothing here);
* the attention is written out for the Llama family (Llama, Mistral without a window,
  Qwen2 with its q/k/v bias, Qwen3 with its per-head q/k norms): q, k, v projections,
  rotary, the new key and value written to the `StaticKVCache` slot, then GQA as two
  batched products over (kv head, group) without repeating the cache, softmax in fp32.

Only the decode steps go through here: the prefill (the prompt tokens, where the
trainer's masks and positions matter most) stays on the model's forward and writes the
same cache buffers. Exactness is tested like the rest of the engine: logits equal the
HF step's, greedy equals the full-forward argmax, engine logprobs equal the trainer's.

`LeanStep.build(model)` returns None where the model is not one of these (a sliding
window, another architecture, a layer without the expected parts): the engine then keeps
the HF forward. Legend: M live rows, H query heads, K kv heads, G = H / K, D head dim,
S cache slots written so far (after this token), V vocab.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid_rl.models.loading import all_full_attention
from hybrid_rl.rollout.native.kv_cache import StaticKVCache

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _inner(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The decoder stack (`model.model` of a *ForCausalLM) when it has the parts the step uses."""
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head"):
        return None
    return inner


def unsupported_reason(model: torch.nn.Module) -> Optional[str]:
    """Why the lean step cannot run `model` (None when it can)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {SUPPORTED}"
    if not all_full_attention(model):
        return "not every layer attends to the whole past (a sliding window or attention chunks)"
    inner = _inner(model)
    if inner is None:
        return "no model.embed_tokens / layers / norm / rotary_emb or lm_head"
    for i, layer in enumerate(inner.layers):
        if not all(hasattr(layer, p) for p in _LAYER_PARTS):
            return f"layer {i} lacks one of {_LAYER_PARTS}"
        attn = layer.self_attn
        if not all(hasattr(attn, p) for p in _ATTN_PARTS + ("head_dim", "scaling")):
            return f"layer {i}'s attention lacks one of {_ATTN_PARTS}, head_dim, scaling"
    return None


class LeanStep:
    """Callable: logits_MV of the next token for ids_M1 at positions pos_M1 over `cache`."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.inner = _inner(model)
        config = model.config
        self.H = config.num_attention_heads
        self.K = getattr(config, "num_key_value_heads", None) or self.H
        self._cos_SD: torch.Tensor | None = None  # the rotary table, built at the first step
        self._sin_SD: torch.Tensor | None = None  # sin with its first half negated (see _rotate)

    @classmethod
    def build(cls, model: torch.nn.Module) -> Optional["LeanStep"]:
        return cls(model) if unsupported_reason(model) is None else None

    def __call__(
        self, ids_M1: torch.Tensor, pos_M1: torch.Tensor, attn_MS: torch.Tensor, cache: StaticKVCache
    ) -> torch.Tensor:
        """attn_MS: True where a row may attend, for the S = cache.length + 1 slots including this
        token's; in the cache's full-length mode (the CUDA-graph step) for all cache.max_len slots,
        and the new key and value go to the device-side `cache.write_slot`."""
        inner, M = self.inner, ids_M1.shape[0]
        slot = cache.length
        if slot >= cache.max_len:
            raise RuntimeError(f"KV cache overflow: slot {slot} of {cache.max_len}")
        S = cache.max_len if cache.full_length else slot + 1
        if attn_MS.shape != (M, S):
            raise ValueError(f"mask {tuple(attn_MS.shape)} for {M} rows and {S} slots")
        x = inner.embed_tokens(ids_M1)  # (M, 1, hidden)
        cos, sin = self._rotary(x, pos_M1, cache.max_len + 1)
        x = x[:, 0]
        # Additive mask in the scores' shape (M, K, G, S) by broadcasting.
        bias_M11S = torch.zeros(attn_MS.shape, dtype=torch.float32, device=x.device).masked_fill_(
            ~attn_MS, float("-inf")
        )[:, None, None, :]
        for i, layer in enumerate(inner.layers):
            h = layer.input_layernorm(x)
            x = x + self._attention(layer.self_attn, h, cos, sin, bias_M11S, cache, i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x))

    def _rotary(self, x: torch.Tensor, pos_M1: torch.Tensor, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (M, 1, D) at pos_M1: rows of a table over positions 0..n_pos-1 that the
        model's rotary module computes once (a decode step then indexes it instead of recomputing)."""
        if self._cos_SD is None or self._cos_SD.shape[0] < n_pos:
            cos_1SD, sin_1SD = self.inner.rotary_emb(x, torch.arange(n_pos, device=x.device)[None])
            half = cos_1SD.shape[-1] // 2
            self._cos_SD = cos_1SD[0]
            self._sin_SD = torch.cat((-sin_1SD[0, :, :half], sin_1SD[0, :, half:]), dim=-1)
        M = pos_M1.shape[0]
        pos_M = pos_M1.reshape(M)
        return (self._cos_SD.index_select(0, pos_M).view(M, 1, -1), self._sin_SD.index_select(0, pos_M).view(M, 1, -1))

    def _attention(self, attn, h_MC, cos_M1D, sin_M1D, bias_M11S, cache: StaticKVCache, i: int) -> torch.Tensor:
        M, H, K, D = h_MC.shape[0], self.H, self.K, attn.head_dim
        q_MHD = attn.q_proj(h_MC).view(M, H, D)
        k_MKD = attn.k_proj(h_MC).view(M, K, D)
        v_MKD = attn.v_proj(h_MC).view(M, K, D)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotary
            q_MHD, k_MKD = attn.q_norm(q_MHD), attn.k_norm(k_MKD)
        q_MHD, k_MKD = _rotate(q_MHD, cos_M1D, sin_M1D), _rotate(k_MKD, cos_M1D, sin_M1D)
        keys, values = cache.layers[i].keys, cache.layers[i].values  # (M, K, S_max, D) views of the live rows
        if cache.full_length:  # fixed shapes and addresses: the slot is a device tensor, every slot is read
            keys.index_copy_(2, cache.write_slot, k_MKD[:, :, None])
            values.index_copy_(2, cache.write_slot, v_MKD[:, :, None])
            k_MKSD, v_MKSD = keys, values
        else:
            slot = cache.length
            keys[:, :, slot] = k_MKD
            values[:, :, slot] = v_MKD
            k_MKSD, v_MKSD = keys[:, :, : slot + 1], values[:, :, : slot + 1]
        # Query head h reads kv head h // G (transformers' repeat_kv order): view q as (M, K, G, D).
        scores_MKGS = torch.matmul(q_MHD.view(M, K, H // K, D), k_MKSD.transpose(-1, -2)).float()
        probs_MKGS = (scores_MKGS * attn.scaling + bias_M11S).softmax(-1).to(v_MKSD.dtype)
        out_MKGD = torch.matmul(probs_MKGS, v_MKSD)
        return attn.o_proj(out_MKGD.reshape(M, H * D))


def _rotate(x_MHD: torch.Tensor, cos_M1D: torch.Tensor, signed_sin_M1D: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it, x * cos + rotate_half(x) * sin, in fewer ops:
    rotate_half(x) = cat(-x2, x1), so rotate_half(x) * sin = roll(x, D/2) * cat(-sin1, sin2) (bit-exact)."""
    return x_MHD * cos_M1D + x_MHD.roll(x_MHD.shape[-1] // 2, dims=-1) * signed_sin_M1D
