"""Padding-free scoring: a micro-batch's sequences packed end to end, log-probs back in the padded layout.

`packed_response_logprobs` is the micro-batch forward of SCORE and TRAIN. For the models
`shared_prefix` supports it runs the distinct-token row there (each prompt once); for the
others (and flash-attention varlen) the packed rows below.

The padded layout (`models.logprobs`) runs every row to the longest one: at 32 new
tokens with answers of ~17 on average, four tokens of ten are padding. Packed, each
sequence (its real prompt tokens, then its response tokens) is laid end to end in
rows of `capacity` slots, with position ids restarting at 0 where a sequence starts.
Transformers reads that layout from the position ids when no attention mask is given:
flash-attention 2 runs it as varlen (cu_seqlens; one row only), sdpa and eager get a
block-diagonal causal mask (any number of rows, each row's attention costing what a
padded row of the same length costs). Either way no sequence sees another's tokens,
and the positions are exactly the padded layout's (`position_ids`: real tokens only).

Packing is not free (the layout's index copies, the block-diagonal mask transformers
builds from the position ids), so a micro-batch whose packed rows would save less than
`min_saving` of the padded slots (short responses of similar length: nothing to pack
together) is scored padded instead; both give the same values.

The result is the padded layout's (N, T) log-probs and entropies, with 0 at padding,
so the loss, its normaliser and every metric are computed as before: packing changes
which matrix shapes the model runs, not the loss.

Legend: N sequences, P prompt columns (left-padded), T response columns, L = P + T,
R packed rows of C slots, K real tokens, Q scored (response) tokens, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_rl.models import shared_prefix
from hybrid_rl.models.loading import attention_implementation
from hybrid_rl.models.logprobs import check_layout, head_logprobs, response_logprobs, scatter_responses

VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
MIN_SAVING = 0.1  # pack a micro-batch only when that runs at least 10% fewer slots than padding


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in bins whose sums stay within capacity (longest first, each into the first bin it fits).

    A bin whose room is below the shortest length can take nothing more and leaves the
    scan, so short sequences of similar length (every bin full after one) cost O(N).
    """
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit in a packed row of {capacity}")
    shortest = min(lengths, default=0)
    bins: list[list[int]] = []
    room: list[int] = []
    open_bins: list[int] = []  # bins that may still take a sequence, in creation order
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        k = next((k for k, b in enumerate(open_bins) if room[b] >= n), None)
        if k is None:
            bins.append([])
            room.append(capacity)
            open_bins.append(len(bins) - 1)
            k = len(open_bins) - 1
        b = open_bins[k]
        bins[b].append(i)
        room[b] -= n
        if room[b] < shortest:
            del open_bins[k]
    return bins


@dataclass
class PackedLayout:
    """Where each padded (n, column) goes in the packed (R, C) rows, and which slots are scored."""

    ids_RC: torch.Tensor
    pos_RC: torch.Tensor
    pred_Q: torch.Tensor  # flat packed slot whose hidden state predicts response token q
    target_Q: torch.Tensor  # that token's id
    row_Q: torch.Tensor  # (n, t) of response token q in the padded layout
    col_Q: torch.Tensor
    real_tokens: int


def plan_rows(attn_NL: torch.Tensor, one_row: bool) -> tuple[list[int], int, list[list[int]]]:
    """(lengths, capacity C, bins): each sequence's real tokens and the packed rows' members.

    one_row: a single row holding everything (varlen attention); otherwise rows as long as
    the longest sequence, filled first-fit-decreasing, so attention per row never costs more
    than the padded layout's.
    """
    # Host copy, on purpose: the packing plan is Python lists of sizes (one per micro-batch).
    lengths = attn_NL.sum(1).tolist()
    capacity = sum(lengths) if one_row else max(lengths)
    return lengths, capacity, first_fit_decreasing(lengths, capacity)


def pack(
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    one_row: bool,
    plan: tuple[list[int], int, list[list[int]]] | None = None,
) -> PackedLayout:
    """Lay the real tokens of each row end to end, in the rows of `plan` (default `plan_rows`).

    The prompt's real tokens must end at column P (left padding) and the response's start
    there (right padding): the layout both engines produce.
    """
    N, L = ids_NL.shape
    dev = ids_NL.device
    p_N = attn_NL[:, :P].sum(1)
    lengths, capacity, bins = plan or plan_rows(attn_NL, one_row)
    len_N = torch.tensor(lengths, device=dev)
    row_of, offset_of = [0] * N, [0] * N
    for r, members in enumerate(bins):
        used = 0
        for i in members:
            row_of[i], offset_of[i] = r, used
            used += lengths[i]
    R, C = len(bins), capacity
    # Every real token k: its sequence, its place in it, its padded column, its packed slot.
    seq_K = torch.repeat_interleave(torch.arange(N, device=dev), len_N)
    start_N = torch.cumsum(len_N, 0) - len_N
    j_K = torch.arange(seq_K.numel(), device=dev) - start_N[seq_K]
    col_K = P - p_N[seq_K] + j_K
    slot_K = torch.tensor(row_of, device=dev)[seq_K] * C + torch.tensor(offset_of, device=dev)[seq_K] + j_K
    ids_RC = torch.zeros(R * C, dtype=ids_NL.dtype, device=dev)
    ids_RC[slot_K] = ids_NL[seq_K, col_K]
    # Unused slots (at a row's end) read position 0: causal attention never lets an earlier slot see them.
    pos_flat = torch.zeros(R * C, dtype=torch.long, device=dev)
    pos_flat[slot_K] = j_K
    resp_K = j_K >= p_N[seq_K]
    return PackedLayout(
        ids_RC=ids_RC.view(R, C),
        pos_RC=pos_flat.view(R, C),
        pred_Q=slot_K[resp_K] - 1,
        target_Q=ids_NL[seq_K[resp_K], col_K[resp_K]],
        row_Q=seq_K[resp_K],
        col_Q=col_K[resp_K] - P,
        real_tokens=sum(lengths),
    )


def packed_response_logprobs(
    model: torch.nn.Module,
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    min_saving: float | None = None,
    share_prompts: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`response_logprobs` without computing padding: (N, T) logp and entropy, 0 where attn_NL is 0.

    Where the model supports it (`shared_prefix.unsupported_reason`; share_prompts None)
    the micro-batch runs as one row of distinct tokens, each distinct prompt once
    (`models.shared_prefix`); otherwise (share_prompts False, or varlen attention, or
    another model) as first-fit-decreasing packed rows. Padded instead when the chosen
    layout would save less than `min_saving` (default `MIN_SAVING`) of the N x L slots;
    0: never padded.
    """
    min_saving = MIN_SAVING if min_saving is None else min_saving
    N, T = check_layout(ids_NL, attn_NL, P)
    limit = (1.0 - min_saving) * ids_NL.numel()
    if share_prompts is None:
        share_prompts = shared_prefix.unsupported_reason(model) is None
    if share_prompts:
        shared = shared_prefix.build_layout(ids_NL, attn_NL, P)
        if shared.tokens <= limit:
            return shared_prefix.shared_prefix_logprobs(model, ids_NL, attn_NL, P, temperature, chunk_tokens, shared)
        return _padded(model, ids_NL, attn_NL, P, temperature, chunk_tokens)
    one_row = attention_implementation(model) in VARLEN_ATTENTION
    plan = plan_rows(attn_NL, one_row)
    _, capacity, bins = plan
    if len(bins) * capacity > limit:
        return _padded(model, ids_NL, attn_NL, P, temperature, chunk_tokens)
    layout = pack(ids_NL, attn_NL, P, one_row, plan)

    def select(hidden_RCH: torch.Tensor) -> torch.Tensor:
        return hidden_RCH.reshape(-1, hidden_RCH.shape[-1])[layout.pred_Q]

    logp_Q, ent_Q = head_logprobs(
        model,
        select,
        layout.target_Q,
        temperature,
        chunk_tokens,
        input_ids=layout.ids_RC,
        position_ids=layout.pos_RC,
        attention_mask=None,
        logits_to_keep=0,
    )
    return scatter_responses((logp_Q, ent_Q), layout.row_Q, layout.col_Q, N, T)


def _padded(model, ids_NL, attn_NL, P, temperature, chunk_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    resp_NT = attn_NL[:, P:]
    logp_NT, ent_NT = response_logprobs(model, ids_NL, attn_NL, P, temperature, chunk_tokens)
    return logp_NT * resp_NT, ent_NT * resp_NT
