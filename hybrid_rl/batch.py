"""The batches one step carries from ROLLOUT to TRAIN, this rank's share of them, and how they are cut.

Legend: B prompts (groups) on this rank, G samples per prompt, N = B*G sequences,
P prompt tokens (left-padded), T response tokens (right-padded), L = P + T.

ROLLOUT produces it once: prompt ids as tokenized for the engine (never again),
the completions, and everything later stages need as tensors on the compute
device, each padded once on the host and moved in one copy:

    ids_NL, attn_NL      [pad .. pad prompt | response pad .. pad]
    resp_mask_NT         1.0 on response tokens (the stop token included); for a multi-turn episode
                         1.0 on the tokens the engine sampled only, 0.0 on observation tokens (holes)
    engine_logp_NT       the engine's sampled-token log-probs, 0 on padding
    truncated_N          finish_reason == "length"
    rewards_N, scores_N  task reward; the score the advantage sees (+ overlong shaping)

ADVANTAGE turns a RolloutBatch into a `TrainBatch`: the same ids, the loss mask, the
advantages and the log-probs SCORE computed, all the update (loop/update.py) reads.

How a batch is cut into the pieces a forward runs on (the second half of this file):
`shuffled_rows` draws a mini-batch order that keeps a prompt's G samples together;
`micro_batches` splits a mini-batch's rows by a row count or a token budget, the same
number on every rank (each micro-batch forward is an FSDP collective); `trimmed` cuts a
micro-batch to its longest response. The update (loop/update.py), scoring and the reward model
(rewards/model.py) all batch through here, so they split and trim the same way.
"Group" here means only a prompt's G samples (r // G); a micro-batch is a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybrid_rl.runtime import distributed as D
from hybrid_rl.types import Completion


@dataclass
class RolloutBatch:
    rows: list[dict]  # B dataset rows
    prompt_ids: list[list[int]]  # B, as sent to the engine
    completions: list[Completion]  # N, row-major: G per prompt
    group_size: int
    ids_NL: torch.Tensor
    attn_NL: torch.Tensor
    resp_mask_NT: torch.Tensor
    P: int
    engine_logp_NT: torch.Tensor
    truncated_N: torch.Tensor
    rewards_N: torch.Tensor
    scores_N: torch.Tensor

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def group_ids_N(self) -> torch.Tensor:
        return torch.arange(len(self), device=self.scores_N.device) // self.group_size

    @classmethod
    def build(
        cls,
        rows: list[dict],
        prompt_ids: list[list[int]],
        completions: list[Completion],
        group_size: int,
        rewards_N: torch.Tensor,
        scores_N: torch.Tensor,
        pad_id: int,
        device: torch.device,
        loss_masks: Optional[list[list[int]]] = None,
    ) -> "RolloutBatch":
        """Pad on the host in one pass, then one copy per tensor to `device`.

        loss_masks: per completion, 1 for each token the loss may train (sampled by the engine) and 0 for one it
        must not (an episode's observation tokens, envs/episodes.py); None: every response token."""
        G, B = group_size, len(prompt_ids)
        if len(completions) != B * G or len(rows) != B:
            raise ValueError(f"{len(completions)} completions for {len(rows)} rows / {B} prompts x {G} samples")
        if rewards_N.shape != (B * G,) or scores_N.shape != (B * G,):
            raise ValueError(f"rewards {tuple(rewards_N.shape)} and scores {tuple(scores_N.shape)} must be ({B * G},)")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("an empty prompt cannot be scored: every prompt needs at least one token")
        for i, c in enumerate(completions):
            if len(c.logprobs) != len(c.token_ids):
                raise ValueError(f"completion {i}: {len(c.token_ids)} tokens but {len(c.logprobs)} logprobs")
            if loss_masks is not None and (len(loss_masks[i]) != len(c.token_ids) or set(loss_masks[i]) - {0, 1}):
                raise ValueError(
                    f"completion {i}: a loss mask of 0/1 per token is needed ({len(c.token_ids)} tokens, "
                    f"mask of {len(loss_masks[i])})"
                )
        if loss_masks is not None and len(loss_masks) != len(completions):
            raise ValueError(f"{len(loss_masks)} loss masks for {len(completions)} completions")
        P = max(len(p) for p in prompt_ids)
        T = max(1, max(len(c.token_ids) for c in completions))
        ids, attn, logp, truncated, mask = [], [], [], [], []
        for i, c in enumerate(completions):
            p, n = prompt_ids[i // G], len(c.token_ids)
            ids.append([pad_id] * (P - len(p)) + p + c.token_ids + [pad_id] * (T - n))
            attn.append([0] * (P - len(p)) + [1] * (len(p) + n) + [0] * (T - n))
            mask.append((loss_masks[i] if loss_masks is not None else [1] * n) + [0] * (T - n))
            logp.append(c.logprobs + [0.0] * (T - n))
            truncated.append(c.finish_reason == "length")
        attn_NL = torch.tensor(attn, dtype=torch.long, device=device)
        return cls(
            rows=rows,
            prompt_ids=prompt_ids,
            completions=completions,
            group_size=G,
            ids_NL=torch.tensor(ids, dtype=torch.long, device=device),
            attn_NL=attn_NL,
            resp_mask_NT=torch.tensor(mask, dtype=torch.float32, device=device),
            P=P,
            engine_logp_NT=torch.tensor(logp, dtype=torch.float32, device=device),
            truncated_N=torch.tensor(truncated, dtype=torch.bool, device=device),
            rewards_N=rewards_N.to(device),
            scores_N=scores_N.to(device),
        )


@dataclass
class TrainBatch:
    """This rank's sequences with everything the loss needs (all on the compute device)."""

    ids_NL: torch.Tensor
    attn_NL: torch.Tensor
    mask_NT: torch.Tensor  # float, 1 = response token in the loss
    P: int
    adv_NT: torch.Tensor  # advantage per token (a sequence-level estimator repeats its value)
    old_logp_NT: torch.Tensor | None = None  # None: on-policy, the update's own forward is the old policy
    ref_logp_NT: torch.Tensor | None = None
    weight_NT: torch.Tensor | None = None  # rollout-correction importance weight (TIS), detached
    engine_logp_NT: torch.Tensor | None = None  # the sampler's log-probs, for the mismatch metric
    group_size: int = 1  # rows per prompt, laid out contiguously (G); mini-batches are shuffled group by group
    values_NT: torch.Tensor | None = None  # PPO (algorithm.advantage=gae): the critic's values in SCORE, 0 on padding
    returns_NT: torch.Tensor | None = None  # PPO: GAE's returns, the critic's regression target

    def __len__(self) -> int:
        return self.ids_NL.shape[0]


# -- how a batch is cut: mini-batch orders, micro-batches, trims ---------------------------------------
def response_ends(mask_NT: torch.Tensor) -> list[int]:
    """Per row, one past the last token in the loss (0 for an empty row); one host copy per step."""
    pos_NT = torch.arange(1, mask_NT.shape[1] + 1, device=mask_NT.device)
    return (
        torch.where(mask_NT != 0, pos_NT, 0).amax(dim=1)
        if mask_NT.shape[1]
        else torch.zeros(mask_NT.shape[0], dtype=torch.long)
    ).tolist()


def micro_batches(
    rows: list[int],
    ends: list[int],
    P: int,
    micro_batch_size: int,
    max_tokens: int,
    packed: bool = False,
    group_size: int = 1,
) -> list[list[int]]:
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
        return [rows[i : i + size] for i in range(0, len(rows), size)]

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
            raise RuntimeError(
                f"cannot make {target} micro-batches from {len(rows)} rows; every rank must hold "
                "as many rows per mini-batch"
            )
        half = len(micros[big]) // 2
        micros[big : big + 1] = [micros[big][:half], micros[big][half:]]
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
    return b.ids_NL[rows, : b.P + T], b.attn_NL[rows, : b.P + T], mask[:, :T], T
