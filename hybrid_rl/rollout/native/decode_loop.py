"""The native engine's token loop: sample, check for stops, drop finished rows, one decode step per token.

The loop gets a batch after its prefill (`Prefilled`) and the step function the rollout chose
(`decode_path.py`: CUDA graph, lean step or the model's forward). It calls that step and no
other: it decides no path, falls back to none and retries nothing (a graph that fails raises out
of it, and the engine decodes the batch again through the lean step).

Host synchronisation happens only at the stop checks, every `check_every` tokens: tokens a row
samples after its stop are replaced by pad on the device, so checking late changes no output.
At a check, once enough rows have finished, they are dropped from the batch (cache and per-row
state compacted in place); a fixed-shape step (graphs) shrinks only to graph sizes.

Legend: N rows, M rows still in the batch, A of them alive, S cache slots, T new tokens, V vocab,
K stop ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybrid_rl.rollout.native.kv_cache import StaticKVCache
from hybrid_rl.rollout.native.sampler import sample_tokens
from hybrid_rl.types import Completion, SamplingParams


def alive_rows(done_M: torch.Tensor) -> torch.Tensor:
    """Indices of the rows not finished: the decode loop's only host synchronisation."""
    return torch.nonzero(~done_M).squeeze(1)


def check_every(requested: int | None, device_type: str) -> int:
    """Tokens between stop checks: as requested, else 8 on CUDA (a check waits for the device), else 1."""
    return requested or (8 if device_type == "cuda" else 1)


def graph_size(n: int) -> int:
    """The batch size a CUDA graph is captured for, for n live rows: the next power of two."""
    return 1 << (n - 1).bit_length()


def rows_to_keep(alive_A: torch.Tensor, done_M: torch.Tensor, fixed_shape: bool) -> torch.Tensor | None:
    """Rows (indices into the M live rows) to keep after a stop check, or None to keep all.

    Eager: drop the finished rows once they are at least 1/8 of the batch (a compaction
    copies the live cache, about one decode step's KV reads). Fixed shape (graphs): shrink to
    the graph size of the live rows, filled up with finished rows, so few graphs are ever captured.
    """
    M, A = done_M.numel(), alive_A.numel()
    if fixed_shape:
        target = graph_size(A)
        if target >= M:
            return None
        return torch.cat([alive_A, torch.nonzero(done_M).squeeze(1)[: target - A]])
    if M - A < max(1, M // 8):
        return None
    return alive_A


@dataclass
class Prefilled:
    """A batch after its prefill: cache (N rows, S slots), attention mask attn_NS (True = a slot the
    next step may read), each row's next position pos_N1 and its first logits_NV (the loop takes them)."""

    cache: StaticKVCache
    attn_NS: torch.Tensor
    pos_N1: torch.Tensor
    logits_NV: Optional[torch.Tensor]
    P: int


def decode(
    batch: Prefilled, step, sp: SamplingParams, u_NT: torch.Tensor | None, stop_K: torch.Tensor, pad_id: int, every: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """toks_NT, lps_NT (pad / 0 after a row's stop). Per token: sample (u_NT: the rows' uniforms, None
    for greedy), check for stops every `every` tokens (dropping finished rows), then `step`, the
    rollout's one step function: step(ids_M1, pos_M1, attn_MS, t) -> logits_MV."""
    cache, attn_NS, pos_M1, P = batch.cache, batch.attn_NS, batch.pos_N1, batch.P
    logits_MV, batch.logits_NV = batch.logits_NV, None  # the (N, V) prefill logits die at the first step
    (N, _), T, dev = attn_NS.shape, sp.max_new_tokens, attn_NS.device
    toks_NT = torch.full((N, T), pad_id, dtype=torch.long, device=dev)
    lps_NT = torch.zeros((N, T), dtype=torch.float32, device=dev)
    rows_M = torch.arange(N, device=dev)  # original row of each live row
    done_M = torch.zeros(N, dtype=torch.bool, device=dev)
    for t in range(T):
        if t < sp.min_new_tokens:  # stops banned: the draw and its logprob see them at -inf, as vLLM's min_tokens
            logits_MV = logits_MV.index_fill(-1, stop_K, float("-inf"))
        tok_M, lp_M = sample_tokens(logits_MV, sp, None if u_NT is None else u_NT[rows_M, t].unsqueeze(1))
        tok_M = torch.where(done_M, pad_id, tok_M)
        toks_NT[rows_M, t] = tok_M
        lps_NT[rows_M, t] = lp_M
        done_M = done_M | torch.isin(tok_M, stop_K)
        if t == T - 1:
            break
        if (t + 1) % every == 0:
            alive_A = alive_rows(done_M)
            if alive_A.numel() == 0:
                break
            keep = rows_to_keep(alive_A, done_M, step.fixed_shape)
            if keep is not None:
                cache.keep_rows(keep)
                attn_NS[: keep.numel()] = attn_NS[keep]
                rows_M, done_M, pos_M1, tok_M = rows_M[keep], done_M[keep], pos_M1[keep], tok_M[keep]
        M = rows_M.numel()
        attn_NS[:M, P + t] = True
        logits_MV = step(tok_M[:, None], pos_M1, attn_NS[:M], t)
        cache.advance(1)
        pos_M1 = pos_M1 + 1
    return toks_NT, lps_NT


def to_completions(toks_NT: torch.Tensor, lps_NT: torch.Tensor, stop_K: torch.Tensor) -> list[Completion]:
    """Each row cut after its first stop id ("stop"), else whole ("length")."""
    toks, lps = toks_NT.tolist(), lps_NT.tolist()
    stops = set(stop_K.tolist())
    out = []
    for row, lrow in zip(toks, lps):
        n, reason = len(row), "length"
        for j, tok in enumerate(row):
            if tok in stops:
                n, reason = j + 1, "stop"
                break
        out.append(Completion(token_ids=row[:n], logprobs=lrow[:n], finish_reason=reason))
    return out
