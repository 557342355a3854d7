"""One policy update over a batch: epochs x mini-batches x micro-batches.

Legend: N sequences on this rank, L = P + T tokens (P prompt, T response).

The loss normaliser of a mini-batch is global (summed over its micro-batches and
over ranks) so gradient accumulation and data parallelism give the gradient of
one big batch. FSDP2 averages gradients over ranks; the loss is multiplied by the
world size to turn that average back into the sum the normaliser expects.

Old-policy log-probs are computed once per step, before the first epoch
(`score_logprobs`, in SCORE), so every epoch and mini-batch measures its ratio
against the policy that generated the batch. `scores_old_policy` is the one place
that decides when that pass can be skipped: an on-policy update (one epoch, one
mini-batch) whose masks and rewards need nothing from the old log-probs before
it starts. Then the update's own forward, detached, is the old policy
(`TrainBatch.old_logp_NT is None`).
Per-token loss: policy loss (x the rollout-correction weight) + kl_coef x KL to
the reference (when the KL is placed in the loss) - entropy_coef x entropy.

The update runs the policy in train mode (`train_mode`) and puts it back in eval mode
after: transformers recomputes checkpointed layers only in train mode, and the rollout
and scoring forwards stay in eval mode (dropout is off in both, `models.fsdp.prepare_policy`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from hybrid_rl import distributed as D
from hybrid_rl.algorithms.aggregation import aggregate_loss, masked_sum, normalizer_count
from hybrid_rl.algorithms.kl import kl_estimate
from hybrid_rl.algorithms.losses import compute_policy_loss
from hybrid_rl.config import AlgorithmConfig
from hybrid_rl.metrics import MeanAccumulator
from hybrid_rl.models.logprobs import response_logprobs
from hybrid_rl.models.packing import packed_response_logprobs


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

    def __len__(self) -> int:
        return self.ids_NL.shape[0]


def trimmed(b: TrainBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Rows of the batch cut to their longest response (padding columns cost compute): ids, attn, mask, T."""
    mask = b.mask_NT[rows]
    # Host sync: the slice bound is a Python int.
    T = int(mask.sum(0).nonzero().max().item()) + 1 if mask.any() else 1
    return b.ids_NL[rows, :b.P + T], b.attn_NL[rows, :b.P + T], mask[:, :T], T


def response_ends(mask_NT: torch.Tensor) -> list[int]:
    """Per row, one past the last token in the loss (0 for an empty row); one host copy per step."""
    pos_NT = torch.arange(1, mask_NT.shape[1] + 1, device=mask_NT.device)
    return (torch.where(mask_NT != 0, pos_NT, 0).amax(dim=1) if mask_NT.shape[1] else
            torch.zeros(mask_NT.shape[0], dtype=torch.long)).tolist()


def micro_batches(rows: list[int], ends: list[int], P: int, micro_batch_size: int, max_tokens: int,
                  packed: bool = False, group_size: int = 1) -> list[list[int]]:
    """Split a mini-batch's rows into micro-batches, the same NUMBER on every rank.

    max_tokens == 0: consecutive groups of micro_batch_size rows; packed with group_size G > 1
    and micro_batch_size >= G, of the largest multiple of G rows within micro_batch_size
    (the rows come in whole prompt groups, `shuffled_rows`, so each micro-batch then holds
    whole groups and runs each prompt once: 15 rows at micro_batch_size 16 and G = 5,
    instead of 16 rows that split a group). Otherwise rows are sorted
    by length and grouped while the group's cost stays within max_tokens: padded, rows x
    (P + the longest response in the group) (each micro-batch is trimmed to its longest
    response); packed, the sum of P + each row's response (at most its real tokens: no
    padding is computed). Packed with group_size G > 1 (rows r with equal r // G share a
    prompt), a prompt's rows stay together: a group costs P + its responses (the prompt runs
    once, `models.shared_prefix`), groups are sorted by cost, and a group over the budget is
    split into its rows. A row longer than the budget goes alone. Every micro-batch forward is an FSDP
    collective, so the ranks agree on the count (an all-reduce of the max) and a rank with
    fewer splits its largest groups until it has as many. The loss is unchanged: its
    normaliser is global, so grouping only changes the summation order.
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
    groups, current, longest, total = [], [], 0, 0
    for unit in units:
        cost = packed_cost(unit)
        group_cost = total + cost if packed else max(longest, cost) * (len(current) + 1)
        if current and group_cost > max_tokens:
            groups.append(current)
            current, longest, total = [], 0, 0
        current += unit
        longest, total = max(longest, cost), total + cost
    if current:
        groups.append(current)
    target = int(D.all_reduce_max(torch.tensor([len(groups)], dtype=torch.int64)).item())
    while len(groups) < target:
        big = max(range(len(groups)), key=lambda g: len(groups[g]))
        if len(groups[big]) < 2:
            raise RuntimeError(f"cannot make {target} micro-batches from {len(rows)} rows; every rank must hold "
                               "as many rows per mini-batch")
        half = len(groups[big]) // 2
        groups[big:big + 1] = [groups[big][:half], groups[big][half:]]
    return groups


def shuffled_rows(n: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """A random order of n rows that keeps each group of `group_size` contiguous rows together.

    A prompt's G samples then land in the same mini-batch (as in verl, which splits without
    shuffling), where the micro-batch forward computes their shared prompt once
    (`models.shared_prefix`). Rows that do not divide into groups are shuffled one by one.
    """
    if group_size <= 1 or n % group_size:
        return torch.randperm(n, generator=gen)
    groups = torch.randperm(n // group_size, generator=gen)
    return (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)


def is_on_policy(algo: AlgorithmConfig, n_global: int) -> bool:
    """One epoch over one mini-batch: the policy that takes the step is the one that generated the batch."""
    return algo.ppo_epochs == 1 and algo.mini_batch_size in (0, n_global)


def scores_old_policy(algo: AlgorithmConfig, n_global: int) -> bool:
    """Does SCORE run the policy's forward for old log-probs? (the one place the on-policy shortcut is decided)

    Needed when the update is off-policy (epochs or mini-batches), when the rollout
    correction compares them with the engine's before the update, or when the KL
    to the reference shapes the reward before the advantages.
    """
    kl_in_reward = algo.needs_ref_model and algo.kl_placement == "reward"
    return not is_on_policy(algo, n_global) or algo.rollout_correction != "none" or kl_in_reward


def logprob_function(packing: bool):
    """The forward that scores a micro-batch: padding-free (`models.packing`) or padded."""
    return packed_response_logprobs if packing else response_logprobs


@torch.no_grad()
def score_logprobs(model: torch.nn.Module, ids_NL: torch.Tensor, attn_NL: torch.Tensor, P: int,
                   temperature: float, micro_batch_size: int, max_tokens: int = 0, packing: bool = False,
                   group_size: int = 1) -> torch.Tensor:
    """logp_NT of the response tokens (0 on padding), no gradients, in the update's micro-batches.

    Same grouping and trimming as the update (`micro_batches`, `trimmed`): rows by length
    under a token budget, each micro-batch cut to its longest response.
    """
    N, T = ids_NL.shape[0], ids_NL.shape[1] - P
    resp_mask_NT = attn_NL[:, P:]
    ends = response_ends(resp_mask_NT)
    forward = logprob_function(packing)
    logp_NT = torch.zeros((N, T), dtype=torch.float32, device=ids_NL.device)
    for group in micro_batches(list(range(N)), ends, P, micro_batch_size, max_tokens, packing, group_size):
        rows = torch.tensor(group, device=ids_NL.device)
        Tg = max(1, max(ends[r] for r in group))
        logp, _ = forward(model, ids_NL[rows, :P + Tg], attn_NL[rows, :P + Tg], P, temperature)
        logp_NT[rows, :Tg] = logp * resp_mask_NT[rows, :Tg]
    return logp_NT


@contextlib.contextmanager
def train_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in train mode for the block, then every submodule back in the mode it had."""
    before = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield model
    finally:
        for m, training in before:
            m.training = training


def policy_update(
    *,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: TrainBatch,
    algo: AlgorithmConfig,
    temperature: float,
    micro_batch_size: int,
    grad_clip: float,
    norm_length: int,
    seed: int,
    kl_coef: float | None = None,
    max_tokens_per_micro_batch: int = 0,
    packing: bool = False,
) -> dict[str, float]:
    """Epochs x mini-batches x micro-batches of `batch`; returns the update's metrics (reduced over ranks).

    kl_coef: the KL coefficient for this step (a controller's value); None means algo.kl_coef.
    Every rank must hold the same number of rows: each micro-batch forward is a collective.
    Metrics measured on the policy that generated the batch (first epoch: `old` vs engine
    and vs reference) are actor/... and rollout/logp_mismatch; the rest average over updates.
    The policy runs in train mode here (activation checkpointing acts only then), and leaves in
    the mode it came in.
    """
    with train_mode(policy):
        kl_coef = algo.kl_coef if kl_coef is None else kl_coef
        kl_in_loss = algo.kl_placement == "loss" and kl_coef > 0
        if kl_in_loss and batch.ref_logp_NT is None:
            raise ValueError("the KL is placed in the loss (algorithm.kl_placement=loss, kl_coef > 0) "
                             "but the batch has no reference log-probs")
        clip_low, clip_high = algo.clip_bounds()
        W = D.world_size()
        n_global = len(batch) * W
        mb_local = (algo.mini_batch_size or n_global) // W
        acc = MeanAccumulator()
        gen = torch.Generator().manual_seed(seed)
        ends = response_ends(batch.mask_NT)
        forward = logprob_function(packing)
        for epoch in range(algo.ppo_epochs):
            shuffle = algo.ppo_epochs > 1 or mb_local < len(batch)
            order = shuffled_rows(len(batch), batch.group_size, gen) if shuffle else torch.arange(len(batch))
            for m0 in range(0, len(batch), mb_local):
                mini = order[m0:m0 + mb_local].to(batch.ids_NL.device)
                # Host round trip: the normaliser is a count the ranks sum before any micro-batch runs.
                local_norm = normalizer_count(batch.mask_NT[mini], algo.loss_agg)
                denom = D.all_reduce_sum(torch.tensor([local_norm], dtype=torch.float64)).item()
                # Gradients of the last mini-batch stay until the phase switch frees them on the
                # way to ROLLOUT, so the memory ledger sees them in TRAIN.
                optimizer.zero_grad(set_to_none=True)
                mini_loss = torch.zeros((), device=batch.ids_NL.device)
                for group in micro_batches(order[m0:m0 + mb_local].tolist(), ends, batch.P, micro_batch_size,
                                           max_tokens_per_micro_batch, packing, batch.group_size):
                    rows = torch.tensor(group, device=batch.ids_NL.device)
                    ids, attn, mask, T = trimmed(batch, rows)
                    logp, ent = forward(policy, ids, attn, batch.P, temperature)
                    # On-policy: no scoring forward ran; the policy being updated generated the batch.
                    old = batch.old_logp_NT[rows, :T] if batch.old_logp_NT is not None else logp.detach()
                    ref = batch.ref_logp_NT[rows, :T] if batch.ref_logp_NT is not None else None
                    n_tok = mask.sum()
                    if epoch == 0:
                        acc |= _behaviour_metrics(old, ref, batch, rows, mask, T, algo.kl_estimator)
                    weight = batch.weight_NT[rows, :T] if batch.weight_NT is not None else None
                    loss_NT, pm = compute_policy_loss(
                        algo.policy_loss, logp, old, batch.adv_NT[rows, :T], mask,
                        clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=algo.clip_ratio_c,
                        weight_NT=weight)
                    if kl_in_loss:
                        kl_NT = kl_estimate(logp, ref, algo.kl_estimator, mask_NT=mask)
                        loss_NT = loss_NT + kl_coef * kl_NT
                        acc.add("actor/kl_loss", masked_sum(kl_NT.detach(), mask), n_tok)
                    if algo.entropy_coef > 0:
                        loss_NT = loss_NT - algo.entropy_coef * ent
                    acc.add("actor/entropy", masked_sum(ent.detach(), mask), n_tok)
                    loss = aggregate_loss(loss_NT, mask, algo.loss_agg, denom, norm_length=norm_length)
                    (loss * W).backward()
                    mini_loss = mini_loss + loss.detach()
                    for k, v in pm.items():
                        if k == "ratio_max":  # the step's extremes, not a mean of micro-batch extremes
                            acc.add_max(f"actor/{k}", torch.where(n_tok > 0, v, float("-inf")))
                        elif k == "ratio_min":
                            acc.add_min(f"actor/{k}", torch.where(n_tok > 0, v, float("inf")))
                        else:
                            acc.add(f"actor/{k}", v * n_tok, n_tok)
                # Each rank holds its share of the mini-batch loss; the shares sum to the total.
                acc.add("actor/loss", mini_loss, 1.0 / W)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
                # Host sync, on purpose: a non-finite step must stop before it reaches the weights.
                if not torch.isfinite(grad_norm):
                    raise FloatingPointError(f"gradient norm is {grad_norm.item()}; lower optim.lr or check the "
                                             "reward scale")
                acc.add("actor/lr", optimizer.param_groups[0]["lr"])  # the lr this update uses
                optimizer.step()
                scheduler.step()
                acc.add("actor/grad_norm", grad_norm)
        return acc.reduce()


def _behaviour_metrics(old_NT, ref_NT, batch: TrainBatch, rows, mask_NT, T: int, kl_estimator: str) -> MeanAccumulator:
    """Measured on the policy that generated the batch: its log-probs vs the engine's and vs the reference."""
    acc = MeanAccumulator()
    n_tok = mask_NT.sum()
    if batch.engine_logp_NT is not None:
        acc.add("rollout/logp_mismatch", masked_sum((old_NT - batch.engine_logp_NT[rows, :T]).abs(), mask_NT), n_tok)
    if ref_NT is not None:
        acc.add("actor/kl_ref", masked_sum(kl_estimate(old_NT, ref_NT, kl_estimator, mask_NT=mask_NT), mask_NT), n_tok)
    return acc
