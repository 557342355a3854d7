"""The native engine's sampler: top-k / top-p filtering and a one-uniform-per-row draw.

The uniform of each row and step can be given (`u_M1`) instead of drawn from a generator:
the engine draws all of a rollout's uniforms up front, one per (sequence, step), so a
sequence's tokens do not depend on which decode batch it lands in (the batch is capped by
the free memory, which varies) or on which rows were dropped before it.

Legend: M rows, V vocab.
"""

from __future__ import annotations

import torch

from hybrid_rl.types import SamplingParams


def filter_logits(logits_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the top-p nucleus."""
    if top_k > 0 and top_k < logits_NV.shape[-1]:
        kth = torch.topk(logits_NV, top_k, dim=-1).values[:, -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_NV, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_NV = logits_NV.masked_fill(drop, float("-inf"))
    return logits_NV


_DRAW_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


Uniforms = torch.Generator | torch.Tensor  # a generator to draw from, or the (M, 1) fp64 uniforms themselves


def _uniforms(u: Uniforms, M: int, device: torch.device) -> torch.Tensor:
    if isinstance(u, torch.Generator):
        return torch.rand((M, 1), generator=u, dtype=torch.float64, device=device)
    if u.shape != (M, 1):
        raise ValueError(f"uniforms of shape {tuple(u.shape)} for {M} rows; expected ({M}, 1)")
    return u


def _draw(w_MV: torch.Tensor, u: Uniforms) -> torch.Tensor:
    """One index per row with probability w / w.sum() (w >= 0, unnormalised), by inverse CDF: one uniform per
    row (u: the (M, 1) uniforms in [0, 1), or a generator to draw them from).

    torch.multinomial draws one exponential per vocabulary entry, and a cumulative sum
    over the vocabulary is a sequential pass; on CPU either costs several times the
    model's own work for a small model. Two levels instead: block sums (one vectorised
    pass), a cumulative sum over the blocks, then one within the chosen block (both in
    fp64, so rounding moves no mass between distant tokens). v = (1 - u) * total is in (0, total]
    and each level takes the first entry whose cumulative sum reaches what is left of v,
    so the entry drawn always has a positive probability: a filtered token never wins.
    """
    M, V = w_MV.shape
    if V <= _DRAW_BLOCK:  # one block: the same draw without the block level (fewer ops per token)
        total_M1 = w_MV.sum(-1, keepdim=True).double()
        v_M1 = (1.0 - _uniforms(u, M, w_MV.device)) * total_M1
        cum_MV = w_MV.cumsum(-1, dtype=torch.float64)
        return torch.searchsorted(cum_MV, torch.minimum(v_M1, cum_MV[:, -1:])).squeeze(1)
    B = _DRAW_BLOCK  # V > B here
    nb = -(-V // B)
    if nb * B != V:
        w_MV = torch.nn.functional.pad(w_MV, (0, nb * B - V))
    blocks_MnB = w_MV.view(M, nb, B)
    cum_Mn = blocks_MnB.sum(-1).double().cumsum(-1)
    v_M1 = (1.0 - _uniforms(u, M, w_MV.device)) * cum_Mn[:, -1:]
    blk_M1 = torch.searchsorted(cum_Mn, v_M1)
    before_M1 = torch.where(blk_M1 > 0, cum_Mn.gather(-1, (blk_M1 - 1).clamp_(min=0)), 0.0)
    inner_MB = blocks_MnB.gather(1, blk_M1[:, :, None].expand(M, 1, B)).squeeze(1).cumsum(-1, dtype=torch.float64)
    rest_M1 = torch.minimum(v_M1 - before_M1, inner_MB[:, -1:])  # block sum and cumsum may differ in the last bit
    return (blk_M1 * B + torch.searchsorted(inner_MB, rest_M1)).squeeze(1)


def sample_tokens(logits_MV: torch.Tensor, sp: SamplingParams, u: Uniforms | None) -> tuple[torch.Tensor, torch.Tensor]:
    """tok_M and lp_M: the next token of each row and its log_softmax(logits / T), before any filtering.
    u: the rows' uniforms (M, 1) or a generator (unused when greedy).

    Greedy: argmax. top_p < 1: the top-k then nucleus mask of `filter_logits` (one sort).
    top_k > 0 alone: a draw among torch.topk's k logits. Otherwise: a draw from the softmax.
    """
    scaled_MV = logits_MV.float()
    if sp.temperature != 1.0:
        scaled_MV = scaled_MV / sp.temperature
    V = scaled_MV.shape[-1]
    if not sp.greedy and sp.top_p >= 1.0 and not 0 < sp.top_k < V:
        # Plain sampling: the unnormalised softmax serves both the draw and the log-sum-exp.
        max_M1 = scaled_MV.amax(-1, keepdim=True)
        w_MV = (scaled_MV - max_M1).exp_()
        lse_M1 = max_M1 + w_MV.sum(-1, keepdim=True).log()
        tok_M = _draw(w_MV, u)
    else:
        lse_M1 = scaled_MV.logsumexp(-1, keepdim=True)
        if sp.greedy:
            tok_M = scaled_MV.argmax(-1)
        elif sp.top_p < 1.0:
            tok_M = _draw(filter_logits(scaled_MV, sp.top_k, sp.top_p).softmax(-1), u)
        else:
            top_MK, idx_MK = scaled_MV.topk(sp.top_k, dim=-1)
            tok_M = idx_MK.gather(-1, _draw((top_MK - top_MK[:, :1]).exp(), u)[:, None]).squeeze(-1)
    lp_M = (scaled_MV.gather(-1, tok_M[:, None]) - lse_M1).squeeze(-1)
    return tok_M, lp_M
