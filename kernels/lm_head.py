"""LM head + per-token log-probability + entropy in chunks of tokens, forward and backward.

Why: `logprob_entropy` on logits avoids the fp32 log-softmax temporaries, but the
logits themselves are still (R, V): 16k tokens at V = 151,936 is 4.98 GB in bf16,
another 9.96 GB in fp32, and autograd keeps them alive until the backward. Here the
head's matmul is folded into the computation: for each chunk of C rows the logits
hidden_CH @ weight_VH^T are built, reduced to (logp, entropy, running max, log-sum)
per row and dropped. The backward saves only hidden_RH (and uses the weight) and
recomputes each chunk's logits, so peak extra memory is O(C * V), not O(R * V);
the price is one extra head matmul in the backward.

Maths, per row, z = logits / temperature (see kernels/logprob.py for the derivation):
    m = max z,  log_s = log sum exp(z - m),  logp = z_target - m - log_s
    H = log_s - sum exp(z - m) (z - m) / exp(log_s)
    dL/dz_j = g_lp (onehot_j - p_j) - g_h p_j (logp_j + H),  dL/dlogits = dL/dz / T
then dL/dhidden = dL/dlogits @ weight and dL/dweight = sum over chunks dL/dlogits^T @ hidden.

Each chunk's softmax runs in fp32 whatever the model dtype (bf16 under FSDP2 mixed
precision); at most a chunk is ever upcast. On CUDA with triton the chunk's
reductions use the fused kernels of kernels/logprob.py (the logits are read in their
own dtype, no fp32 copy at all); elsewhere a chunked torch path computes the same
numbers.

Shapes legend:
    R: rows (tokens), H: hidden size, V: vocabulary size, C: rows per chunk
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from .logprob import _check_device, _launch_bwd, _launch_fwd, _require_triton, triton_available

__all__ = ["chunk_rows", "chunked_logprob_entropy", "default_chunk_tokens"]

# Bytes of one fp32 (C, V) chunk of logits; at Qwen's V = 151,936 that is C = 441
# rows. The torch path holds two such buffers at once (plus the chunk's logits in
# the model dtype when it is not fp32), the Triton path one bf16 logits chunk and
# one bf16 gradient chunk.
_CHUNK_BYTES = 256 * 2**20
# Below this many bytes of fp32 (R, V) logits a call is one chunk (the tiny models'
# case: splitting would only add per-chunk overhead); above it a call takes at least
# _MIN_CHUNKS chunks. The torch path's temporaries are about 2.25 fp32 chunks and the
# naive path's about 6.25 (R, V) copies (benchmarks/results/logprob_memory_*), so four
# chunks keep ours near 0.09 of the naive path's at any R, not only once R is many
# times the 256 MiB chunk.
_ONE_CHUNK_BYTES = 32 * 2**20
_MIN_CHUNKS = 4

_F32_MIN = torch.finfo(torch.float32).min


def default_chunk_tokens(V: int) -> int:
    """The most rows per chunk: one fp32 (C, V) buffer stays near 256 MiB."""
    return max(1, _CHUNK_BYTES // (4 * V))


def chunk_rows(R: int, V: int) -> int:
    """Rows per chunk for R rows at vocabulary V when the caller does not choose.

    One chunk while R x V fp32 logits fit in 32 MiB; above that at least four chunks,
    each at most `default_chunk_tokens(V)` rows.
    """
    if R * V * 4 <= _ONE_CHUNK_BYTES:
        return max(1, R)
    return min(default_chunk_tokens(V), -(-R // _MIN_CHUNKS))


def _chunk_logits(h_CH: Tensor, w_VH: Tensor, b_V: Tensor | None) -> Tensor:
    """The chunk's logits in the model's dtype: a fresh (C, V) tensor."""
    return torch.nn.functional.linear(h_CH, w_VH, b_V)


def _chunk_z(h_CH: Tensor, w_VH: Tensor, b_V: Tensor | None, temperature: float) -> Tensor:
    """fp32 z = logits / temperature, owned by the caller (safe to modify in place)."""
    z_CV = _chunk_logits(h_CH, w_VH, b_V).float()  # fp32 logits: .float() is a no-op, still fresh
    if temperature != 1.0:
        z_CV.div_(temperature)
    return z_CV


def _torch_fwd(z_CV: Tensor, t_C: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy, m, log_s) per row; consumes z_CV (modified in place)."""
    m_C1 = z_CV.amax(-1, keepdim=True)
    # A row of -inf only (a fully masked vocabulary) would give -inf - -inf = NaN;
    # shifting by a finite number keeps the exp at 0 there instead.
    m_C1.clamp_(min=_F32_MIN)
    z_CV.sub_(m_C1)
    zt_C = z_CV.gather(1, t_C.long()[:, None]).squeeze(1)
    e_CV = z_CV.exp()
    s_C = e_CV.sum(-1)
    log_s_C = s_C.log()
    # exp(z - m) = 0 lanes may hold z - m = -inf and 0 * -inf is NaN; their true
    # contribution to sum p (z - m) is 0, and 0 * finfo.min is 0.
    z_CV.clamp_(min=_F32_MIN)
    pz_C = e_CV.mul_(z_CV).sum(-1)
    return zt_C - log_s_C, log_s_C - pz_C / s_C, m_C1.squeeze(1), log_s_C


def _torch_bwd(
    z_CV: Tensor,
    t_C: Tensor,
    m_C: Tensor,
    log_s_C: Tensor,
    ent_C: Tensor,
    g_lp_C: Tensor | None,
    g_h_C: Tensor | None,
    temperature: float,
) -> Tensor:
    """fp32 dL/dlogits (C, V) of the chunk; consumes z_CV."""
    logp_CV = z_CV.sub_(m_C[:, None]).sub_(log_s_C[:, None])
    p_CV = logp_CV.exp()
    if g_h_C is not None:
        # Where p == 0 the true gradient is 0, but logp may be -inf (masked logits)
        # and p * -inf is NaN; any finite logp gives the right 0.
        logp_CV.masked_fill_(p_CV == 0, 0.0)
        coef_CV = logp_CV.add_(ent_C[:, None]).mul_(g_h_C[:, None])
        if g_lp_C is not None:
            coef_CV.add_(g_lp_C[:, None])
        grad_CV = p_CV.mul_(coef_CV).neg_()
    else:
        assert g_lp_C is not None
        grad_CV = p_CV.mul_(-g_lp_C[:, None])
    if g_lp_C is not None:
        grad_CV.scatter_add_(1, t_C.long()[:, None], g_lp_C[:, None])
    if temperature != 1.0:
        grad_CV.div_(temperature)
    return grad_CV


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_RH: Tensor,
        weight_VH: Tensor,
        bias_V: Tensor | None,
        targets_R: Tensor,
        temperature: float,
        chunk: int,
        use_triton: bool,
    ) -> tuple[Tensor, Tensor]:
        R = hidden_RH.shape[0]
        logp_R, ent_R, m_R, log_s_R = (torch.empty(R, device=hidden_RH.device, dtype=torch.float32) for _ in range(4))
        for s in range(0, R, chunk):
            h_CH, t_C = hidden_RH[s : s + chunk], targets_R[s : s + chunk]
            if use_triton:
                out = _launch_fwd(_chunk_logits(h_CH, weight_VH, bias_V), t_C, temperature, None)
            else:
                out = _torch_fwd(_chunk_z(h_CH, weight_VH, bias_V, temperature), t_C)
            for dst, src in zip((logp_R, ent_R, m_R, log_s_R), out):
                dst[s : s + chunk] = src
        # A copy of the entropy, so that a caller editing the output in place does
        # not corrupt what the backward reads.
        ctx.save_for_backward(hidden_RH, weight_VH, bias_V, targets_R, m_R, log_s_R, ent_R.clone())
        ctx.temperature, ctx.chunk, ctx.use_triton = temperature, chunk, use_triton
        # An output nobody differentiates keeps a None grad and its terms are skipped
        # (entropy is often only a metric); response_logprobs stacks both outputs, so
        # there the unused one arrives as zeros instead, an elementwise cost only.
        ctx.set_materialize_grads(False)
        return logp_R, ent_R

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp_R: Tensor | None, g_ent_R: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        nones = (None,) * 4
        if g_logp_R is None and g_ent_R is None:
            return (None, None, None) + nones
        hidden_RH, weight_VH, bias_V, targets_R, m_R, log_s_R, ent_R = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        T, chunk = ctx.temperature, ctx.chunk
        g_lp = g_logp_R.float() if g_logp_R is not None else None
        g_h = g_ent_R.float() if g_ent_R is not None else None
        grad_h_RH = torch.empty_like(hidden_RH) if need_h else None
        # Sum the weight's chunk contributions in fp32: a bf16 running sum would round
        # once per chunk. For bf16 weights this costs an fp32 (V, H) buffer.
        grad_w_VH = torch.zeros(weight_VH.shape, device=weight_VH.device, dtype=torch.float32) if need_w else None
        grad_b_V = torch.zeros(bias_V.shape, device=bias_V.device, dtype=torch.float32) if need_b else None
        for s in range(0, hidden_RH.shape[0], chunk):
            e = s + chunk
            h_CH, t_C = hidden_RH[s:e], targets_R[s:e]
            g_lp_C = g_lp[s:e] if g_lp is not None else None
            g_h_C = g_h[s:e] if g_h is not None else None
            if ctx.use_triton:
                grad_CV = _launch_bwd(
                    _chunk_logits(h_CH, weight_VH, bias_V),
                    t_C,
                    m_R[s:e],
                    log_s_R[s:e],
                    ent_R[s:e],
                    g_lp_C,
                    g_h_C,
                    T,
                    None,
                )
            else:
                grad_CV = _torch_bwd(
                    _chunk_z(h_CH, weight_VH, bias_V, T), t_C, m_R[s:e], log_s_R[s:e], ent_R[s:e], g_lp_C, g_h_C, T
                )
            if need_b:
                grad_b_V.add_(grad_CV.sum(0, dtype=torch.float32))
            grad_CV = grad_CV.to(weight_VH.dtype)  # matmuls in the model's dtype, like the head's own
            if need_h:
                torch.mm(grad_CV, weight_VH, out=grad_h_RH[s:e])
            if need_w:
                if weight_VH.dtype == torch.float32:
                    grad_w_VH.addmm_(grad_CV.t(), h_CH)
                else:
                    grad_w_VH.add_(grad_CV.t() @ h_CH)
            del grad_CV
        if need_w:
            grad_w_VH = grad_w_VH.to(weight_VH.dtype)
        if need_b:
            grad_b_V = grad_b_V.to(bias_V.dtype)
        return (grad_h_RH, grad_w_VH, grad_b_V) + nones


Impl = Literal["auto", "triton", "torch"]


def chunked_logprob_entropy(
    hidden_RH: Tensor,
    weight_VH: Tensor,
    bias_V: Tensor | None,
    targets_R: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    impl: Impl = "auto",
) -> tuple[Tensor, Tensor]:
    """log p(target) and entropy of softmax((hidden @ weight^T + bias) / temperature), fp32.

    Never materialises more than `chunk_tokens` rows of logits, in the forward or the
    backward (which recomputes them). Differentiable w.r.t. hidden, weight and bias;
    gradients of a tied weight accumulate into the shared parameter like any other use.

    Args:
        hidden_RH: (R, H) final hidden states (after the final norm), any float dtype.
        weight_VH: (V, H) LM head weight, same dtype and device as hidden_RH.
        bias_V: (V,) head bias or None.
        targets_R: (R,) integer token ids in [0, V).
        temperature: the logits are divided by it before the softmax (> 0).
        chunk_tokens: rows per chunk; None picks `chunk_rows(R, V)`.
        impl: "auto" (Triton on CUDA when it imports, else torch), "triton", "torch".

    Returns:
        (logp_R, entropy_R), fp32.
    """
    if hidden_RH.dim() != 2 or weight_VH.dim() != 2 or hidden_RH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"hidden {tuple(hidden_RH.shape)} must be (R, H) and weight {tuple(weight_VH.shape)} (V, H)")
    if hidden_RH.dtype != weight_VH.dtype or (bias_V is not None and bias_V.dtype != weight_VH.dtype):
        raise TypeError(f"hidden ({hidden_RH.dtype}), weight ({weight_VH.dtype}) and bias must share a dtype")
    if targets_R.shape != hidden_RH.shape[:1]:
        raise ValueError(f"targets {tuple(targets_R.shape)} must be ({hidden_RH.shape[0]},), one per hidden row")
    if bias_V is not None and bias_V.shape != weight_VH.shape[:1]:
        raise ValueError(f"bias {tuple(bias_V.shape)} must be ({weight_VH.shape[0]},)")
    if targets_R.dtype.is_floating_point or targets_R.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {targets_R.dtype}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (or None for the default), got {chunk_tokens}")
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "triton":
        _require_triton()
        _check_device(hidden_RH)
    use_triton = impl == "triton" or (impl == "auto" and hidden_RH.is_cuda and triton_available())
    chunk = chunk_tokens or chunk_rows(hidden_RH.shape[0], weight_VH.shape[0])
    return _ChunkedLogprobEntropy.apply(
        hidden_RH.contiguous(), weight_VH, bias_V, targets_R.contiguous(), float(temperature), chunk, use_triton
    )
