"""How one rank's batch is cut into the pieces a forward runs on: mini-batch orders, micro-batches, trims.

Legend: N sequences on this rank, P prompt tokens (left-padded), T response tokens (right-padded).

`shuffled_rows` draws a mini-batch order that keeps a prompt's G samples together;
`micro_batches` splits a mini-batch's rows by a row count or a token budget, the same
number on every rank (each micro-batch forward is an FSDP collective); `trimmed` cuts a
micro-batch to its longest response. The update (update.py), scoring and the reward model
(rewards/model.py) all batch through here, so they split and trim the same way.
"Group" here means only a prompt's G samples (r // G); a micro-batch is a micro-batch.
"""
from __future__ import annotations

import torch

from hybrid_rl import distributed as D
from hybrid_rl.batch import TrainBatch


def response_ends(mask_NT: torch.Tensor) -> list[int]:
    """Per row, one past the last token in the loss (0 for an empty row); one host copy per step."""
    pos_NT = torch.arange(1, mask_NT.shape[1] + 1, device=mask_NT.device)
    return (torch.where(mask_NT != 0, pos_NT, 0).amax(dim=1) if mask_NT.shape[1] else
            torch.zeros(mask_NT.shape[0], dtype=torch.long)).tolist()


def micro_batches(rows: list[int], ends: list[int], P: int, micro_batch_size: int, max_tokens: int,
                  packed: bool = False, group_size: int = 1) -> list[list[int]]:
    """Split a mini-batch's rows into micro-batches, the same NUMBER on every rank.

    max_tokens == 0: consecutive runs of micro_batch_size rows; packed with group_size G > 1
    and micro_batch_size >= G, of the largest multiple of G rows within micro_batch_size
    (the rows come in whole prompt groups, `shuffled_rows`, so each micro-batch then holds
    whole groups and runs each prompt once: 15 rows at micro_batch_size 16 and G = 5,
    instead of 16 rows that split a group). Otherwise rows are sorted
    by length and added to a micro-batch while its cost stays within max_tokens: padded, rows x
    (P + the longest response in the micro-batch) (each micro-batch is trimmed to its longest
    response); packed, the sum of P + each row's response (at most its real tokens: no
    padding is computed). Packed with group_size G > 1 (rows r with equal r // G share a
    prompt), a prompt's rows stay together: a group costs P + its responses (the prompt runs
    once, `models.shared_prefix`), groups are sorted by cost, and a group over the budget is
    split into its rows. A row longer than the budget goes alone. Every micro-batch forward is an FSDP
    collective, so the ranks agree on the count (an all-reduce of the max) and a rank with
    fewer splits its largest micro-batches until it has as many. The loss is unchanged: its
    normaliser is global, so the split only changes the summation order.
    """
    if max_tokens <= 0:
        # Same number of rows on every rank, so the same count: nothing to agree on.
        size = micro_batch_size
        if packed and 1 < group_size <= micro_batch_size:
            size -= micro_batch_size % group_size
        return [rows[i:i + size] for i in range(0, len(rows), size)]

    def packed_cost(unit: list[int]) -> int:
        return P + sum(max(1, ends[r]) for r in unit)

    if packed and group_size > 1:
        by_prompt: dict[int, list[int]] = {}
        for r in rows:
            by_prompt.setdefault(r // group_size, []).append(r)
        units = [u for g in by_prompt.values() for u in ([g] if packed_cost(g) <= max_tokens else [[r] for r in g])]
        units.sort(key=packed_cost)
    else:
        units = [[r] for r in sorted(rows, key=lambda i: ends[i])]
    micros, current, longest, total = [], [], 0, 0
    for unit in units:
        cost = packed_cost(unit)
        micro_cost = total + cost if packed else max(longest, cost) * (len(current) + 1)
        if current and micro_cost > max_tokens:
            micros.append(current)
            current, longest, total = [], 0, 0
        current += unit
        longest, total = max(longest, cost), total + cost
    if current:
        micros.append(current)
    target = int(D.all_reduce_max(torch.tensor([len(micros)], dtype=torch.int64)).item())
    while len(micros) < target:
        big = max(range(len(micros)), key=lambda m: len(micros[m]))
        if len(micros[big]) < 2:
            raise RuntimeError(f"cannot make {target} micro-batches from {len(rows)} rows; every rank must hold "
                               "as many rows per mini-batch")
        half = len(micros[big]) // 2
        micros[big:big + 1] = [micros[big][:half], micros[big][half:]]
    return micros


def shuffled_rows(n: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """A random order of n rows that keeps each prompt's group (`group_size` contiguous rows) together.

    A prompt's G samples then land in the same mini-batch (as in verl, which splits without
    shuffling), where the micro-batch forward computes their shared prompt once
    (`models.shared_prefix`). Rows that do not divide into groups are shuffled one by one.
    """
    if group_size <= 1 or n % group_size:
        return torch.randperm(n, generator=gen)
    groups_B = torch.randperm(n // group_size, generator=gen)
    return (groups_B[:, None] * group_size + torch.arange(group_size)).reshape(-1)


def trimmed(b: TrainBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Rows of the batch cut to their longest response (padding columns cost compute): ids, attn, mask, T."""
    mask = b.mask_NT[rows]
    # Host sync: the slice bound is a Python int.
    T = int(mask.sum(0).nonzero().max().item()) + 1 if mask.any() else 1
    return b.ids_NL[rows, :b.P + T], b.attn_NL[rows, :b.P + T], mask[:, :T], T
