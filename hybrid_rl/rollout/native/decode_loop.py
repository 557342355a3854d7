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

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hybrid_rl.rollout.native.kv_cache import StaticKVCache
from hybrid_rl.rollout.native.sampler import sample_tokens
from hybrid_rl.types import Completion, PartialRequest, SamplingParams, groups_complete


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


@dataclass
class RowLimits:
    """A partial rollout's per-row limits (types.PartialRequest) for one decode batch, and what the loop saw.

    max_new_N / min_new_N: each row's budget and minimum (max_new_N <= T); stop(alive): asked at each stop check
    with the original indices of the rows still decoding, True to stop now (the group rule, engine.py). After the
    loop: aborted_N marks the rows stopped unfinished, `stopped_at` the tokens each of them holds; with keep_kv
    (rollout.partial_kv=keep), `kept_kv` maps each of them (its index in the batch) to the keys and values of every
    token it fed (StaticKVCache.rows_kv: its prompt and all its tokens but the last)."""

    max_new_N: torch.Tensor
    min_new_N: torch.Tensor
    stop: Callable[[torch.Tensor], bool]
    aborted_N: Optional[torch.Tensor] = None
    stopped_at: int = 0
    keep_kv: bool = False
    kept_kv: Optional[dict[int, torch.Tensor]] = None


@dataclass
class DecodeStats:
    """What the token loop measured: seconds at the checks where fewer than half of the batch's rows were
    still decoding (the rollout's tail, measured at the stop checks)."""

    tail_s: float = 0.0


class GroupStop:
    """A PartialRequest's stop rule over the engine's decode batches, on the host: a row is finished once its batch
    returned it "stop" or "length"; rows of a batch not yet run are unfinished. Asked at each stop check of the
    running batch with its rows still decoding; re-counts only when that set changed."""

    def __init__(self, partial: PartialRequest):
        self.partial = partial
        self.finished = [False] * len(partial.group_of)
        self._last: tuple[int, bool] = (-1, False)

    def enough(self) -> bool:
        return groups_complete(self.partial.group_of, self.finished) >= self.partial.groups_needed

    def limits(self, start: int, n: int, dev: torch.device) -> RowLimits:
        """One decode batch's RowLimits (rows start..start+n of the request)."""
        p = self.partial

        def stop(alive_A: torch.Tensor) -> bool:
            if alive_A.numel() == self._last[0]:  # rows only ever finish: the same count is the same set
                return self._last[1]
            alive = set(alive_A.tolist())
            for i in range(n):
                self.finished[start + i] = i not in alive
            self._last = (alive_A.numel(), self.enough())
            return self._last[1]

        self._last = (-1, False)
        max_new = torch.tensor(p.max_new_tokens[start : start + n], device=dev)
        min_new = torch.tensor(p.min_new_tokens[start : start + n], device=dev)
        return RowLimits(max_new, min_new, stop, keep_kv=p.keep_kv)

    def record(self, start: int, done: list[Completion]) -> None:
        """A batch's results: its finished rows count for the next batches' rule."""
        for i, c in enumerate(done):
            self.finished[start + i] = c.finish_reason != "abort"


def decode(
    batch: Prefilled,
    step,
    sp: SamplingParams,
    u_NT: torch.Tensor | None,
    stop_K: torch.Tensor,
    pad_id: int,
    every: int,
    limits: RowLimits | None = None,
    stats: DecodeStats | None = None,
    poll: Optional[Callable[[int], None]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """toks_NT, lps_NT (pad / 0 after a row's stop). Per token: sample (u_NT: the rows' uniforms, None
    for greedy), check for stops every `every` tokens (dropping finished rows), then `step`, the
    rollout's one step function: step(ids_M1, pos_M1, attn_MS, t) -> logits_MV. limits: a partial rollout's
    per-row budgets and early stop (a row that reaches its budget is done; the rows alive when `limits.stop`
    says so are marked in `limits.aborted_N`). poll(held): at each stop check, before the next step, with the tokens
    every live row holds (the in-flight weight update, types.WeightUpdates: the step after it runs the new weights)."""
    cache, attn_NS, pos_M1, P = batch.cache, batch.attn_NS, batch.pos_N1, batch.P
    logits_MV, batch.logits_NV = batch.logits_NV, None  # the (N, V) prefill logits die at the first step
    (N, _), T, dev = attn_NS.shape, sp.max_new_tokens, attn_NS.device
    toks_NT = torch.full((N, T), pad_id, dtype=torch.long, device=dev)
    lps_NT = torch.zeros((N, T), dtype=torch.float32, device=dev)
    rows_M = torch.arange(N, device=dev)  # original row of each live row
    done_M = torch.zeros(N, dtype=torch.bool, device=dev)
    if limits is not None:
        min_until = int(limits.min_new_N.max()) if N else 0  # host: the last step where some row bans its stops
        is_stop_V = torch.zeros(logits_MV.shape[-1], dtype=torch.bool, device=dev).index_fill(0, stop_K, True)
    tick = time.perf_counter()
    for t in range(T):
        if limits is not None:
            if t < min_until:  # each row's own min_new_tokens
                ban_M = (t < limits.min_new_N[rows_M])[:, None] & is_stop_V
                logits_MV = logits_MV.masked_fill(ban_M, float("-inf"))
        elif t < sp.min_new_tokens:  # stops banned: the draw and its logprob see them at -inf, as vLLM's min_tokens
            logits_MV = logits_MV.index_fill(-1, stop_K, float("-inf"))
        tok_M, lp_M = sample_tokens(logits_MV, sp, None if u_NT is None else u_NT[rows_M, t].unsqueeze(1))
        tok_M = torch.where(done_M, pad_id, tok_M)
        toks_NT[rows_M, t] = tok_M
        lps_NT[rows_M, t] = lp_M
        done_M = done_M | torch.isin(tok_M, stop_K)
        if limits is not None:
            done_M = done_M | (limits.max_new_N[rows_M] <= t + 1)  # the row's budget is spent
        if t == T - 1:
            break
        if (t + 1) % every == 0:
            alive_A = alive_rows(done_M)
            if stats is not None:
                now = time.perf_counter()
                if 2 * alive_A.numel() < N:
                    stats.tail_s += now - tick
                tick = now
            if alive_A.numel() == 0:
                break
            if limits is not None and limits.stop(rows_M[alive_A]):
                limits.aborted_N = torch.zeros(N, dtype=torch.bool, device=dev).index_fill(0, rows_M[alive_A], True)
                limits.stopped_at = t + 1
                if limits.keep_kv:  # slots 0 .. P + t - 1 are written: the prompt slots, then t fed tokens
                    kv = cache.rows_kv(alive_A, attn_NS[alive_A, : P + t])
                    limits.kept_kv = dict(zip(rows_M[alive_A].tolist(), kv))
                break
            keep = rows_to_keep(alive_A, done_M, step.fixed_shape)
            if keep is not None:
                cache.keep_rows(keep)
                attn_NS[: keep.numel()] = attn_NS[keep]
                rows_M, done_M, pos_M1, tok_M = rows_M[keep], done_M[keep], pos_M1[keep], tok_M[keep]
            if poll is not None:
                poll(t + 1)
        M = rows_M.numel()
        attn_NS[:M, P + t] = True
        logits_MV = step(tok_M[:, None], pos_M1, attn_NS[:M], t)
        cache.advance(1)
        pos_M1 = pos_M1 + 1
    return toks_NT, lps_NT


def to_completions(
    toks_NT: torch.Tensor, lps_NT: torch.Tensor, stop_K: torch.Tensor, limits: RowLimits | None = None
) -> list[Completion]:
    """Each row cut after its first stop id ("stop"), else whole ("length"); with `limits`, a row is whole at its
    own budget, and a row the early stop cut holds the tokens it sampled ("abort")."""
    toks, lps = toks_NT.tolist(), lps_NT.tolist()
    stops = set(stop_K.tolist())
    budgets = None if limits is None else limits.max_new_N.tolist()
    aborted = None if limits is None or limits.aborted_N is None else limits.aborted_N.tolist()
    out = []
    for i, (row, lrow) in enumerate(zip(toks, lps)):
        if aborted is not None and aborted[i]:
            n = limits.stopped_at
            out.append(Completion(token_ids=row[:n], logprobs=lrow[:n], finish_reason="abort"))
            continue
        n, reason = len(row) if budgets is None else budgets[i], "length"
        for j, tok in enumerate(row[:n]):
            if tok in stops:
                n, reason = j + 1, "stop"
                break
        out.append(Completion(token_ids=row[:n], logprobs=lrow[:n], finish_reason=reason))
    return out
