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

from hybrid_rl.algorithms.aggregation import aggregate_loss, masked_sum, normalizer_count
from hybrid_rl.algorithms.kl import kl_estimate
from hybrid_rl.algorithms.losses import compute_policy_loss
from hybrid_rl.batch import TrainBatch, micro_batches, response_ends, shuffled_rows, trimmed
from hybrid_rl.config.schema import AlgorithmConfig, Config
from hybrid_rl.models.logprobs import response_logprobs
from hybrid_rl.models.packing import packed_response_logprobs
from hybrid_rl.observability.metrics import MeanAccumulator
from hybrid_rl.runtime import distributed as D


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
def score_logprobs(
    model: torch.nn.Module,
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    temperature: float,
    micro_batch_size: int,
    max_tokens: int = 0,
    packing: bool = False,
    group_size: int = 1,
) -> torch.Tensor:
    """logp_NT of the response tokens (0 on padding), no gradients, in the update's micro-batches.

    Same micro-batches and trimming as the update (`micro_batches`, `trimmed`): rows by length
    under a token budget, each micro-batch cut to its longest response.
    """
    forward = logprob_function(packing)
    return per_token_in_micro_batches(
        lambda ids, attn: forward(model, ids, attn, P, temperature)[0],
        ids_NL,
        attn_NL,
        P,
        micro_batch_size,
        max_tokens,
        packing,
        group_size,
    )


def per_token_in_micro_batches(
    forward,
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    micro_batch_size: int,
    max_tokens: int = 0,
    packing: bool = False,
    group_size: int = 1,
) -> torch.Tensor:
    """(N, T) fp32 of `forward(ids, attn)` over the response tokens (0 on padding), in the update's micro-batches:
    rows by a row count or a token budget, each micro-batch cut to its longest response. SCORE's log-probs and
    PPO's values (loop/critic_update.py) both go through here."""
    N, T = ids_NL.shape[0], ids_NL.shape[1] - P
    resp_mask_NT = attn_NL[:, P:]
    ends = response_ends(resp_mask_NT)
    out_NT = torch.zeros((N, T), dtype=torch.float32, device=ids_NL.device)
    for micro in micro_batches(list(range(N)), ends, P, micro_batch_size, max_tokens, packing, group_size):
        rows = torch.tensor(micro, device=ids_NL.device)
        Tm = max(1, max(ends[r] for r in micro))  # the micro-batch's longest response
        out_NT[rows, :Tm] = forward(ids_NL[rows, : P + Tm], attn_NL[rows, : P + Tm]) * resp_mask_NT[rows, :Tm]
    return out_NT


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


@dataclass(frozen=True)
class UpdateSettings:
    """What an update reads from the config, gathered once (`from_config`) instead of passed key by key."""

    algo: AlgorithmConfig
    temperature: float  # rollout.temperature: log-probs at the temperature the batch was sampled at
    micro_batch_size: int  # rows per forward/backward (trainer.micro_batch_size)
    grad_clip: float
    norm_length: int  # rollout.max_new_tokens: the constant of the length-normalised aggregations
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches by a token budget (batch.micro_batches)
    packing: bool = False  # padding-free forward (models/packing.py)

    @classmethod
    def from_config(cls, cfg: Config) -> "UpdateSettings":
        t = cfg.trainer
        return cls(
            algo=cfg.algorithm,
            temperature=cfg.rollout.temperature,
            micro_batch_size=t.micro_batch_size,
            grad_clip=cfg.optim.grad_clip,
            norm_length=cfg.rollout.max_new_tokens,
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            packing=t.packing,
        )


def policy_update(
    *,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: TrainBatch,
    settings: UpdateSettings,
    seed: int,
    kl_coef: float | None = None,
) -> dict[str, float]:
    """Epochs x mini-batches x micro-batches of `batch`; returns the update's metrics (reduced over ranks).

    seed: the mini-batch shuffle's (a new one per step); kl_coef: the KL coefficient for this step (a
    controller's value), None means settings.algo.kl_coef.
    Every rank must hold the same number of rows: each micro-batch forward is a collective.
    Metrics measured on the policy that generated the batch (first epoch: `old` vs engine
    and vs reference) are actor/... and rollout/logp_mismatch; the rest average over updates.
    The policy runs in train mode here (activation checkpointing acts only then), and leaves in
    the mode it came in.
    """
    algo = settings.algo
    with train_mode(policy):
        kl_coef = algo.kl_coef if kl_coef is None else kl_coef
        if algo.kl_placement == "loss" and kl_coef > 0 and batch.ref_logp_NT is None:
            raise ValueError(
                "the KL is placed in the loss (algorithm.kl_placement=loss, kl_coef > 0) "
                "but the batch has no reference log-probs"
            )
        acc = MeanAccumulator()
        ends = response_ends(batch.mask_NT)
        for epoch, rows_M in mini_batch_rows(len(batch), batch.group_size, algo.ppo_epochs, algo.mini_batch_size, seed):
            _mini_batch(policy, optimizer, scheduler, batch, rows_M, ends, settings, kl_coef, epoch == 0, acc)
        return acc.reduce()


def global_normalizer(batch: TrainBatch, rows_M: torch.Tensor, loss_agg: str) -> float:
    """The loss's normaliser of the mini-batch `rows_M` over every rank: a host round trip, since it is a count the
    ranks sum before any micro-batch runs (algorithms/aggregation.py). The actor's and the critic's update share it."""
    local_norm = normalizer_count(batch.mask_NT[rows_M.to(batch.ids_NL.device)], loss_agg)
    return D.all_reduce_sum(torch.tensor([local_norm], dtype=torch.float64)).item()


def mini_batch_micros(batch: TrainBatch, rows_M: torch.Tensor, ends: list[int], settings) -> Iterator[list[int]]:
    """The micro-batches (row lists) of the mini-batch `rows_M`, cut by `settings`' micro_batch_size,
    max_tokens_per_micro_batch and packing (UpdateSettings or CriticSettings: the critic cuts as the actor does)."""
    return micro_batches(
        rows_M.tolist(),
        ends,
        batch.P,
        settings.micro_batch_size,
        settings.max_tokens_per_micro_batch,
        settings.packing,
        batch.group_size,
    )


def mini_batch_rows(
    n: int, group_size: int, epochs: int, mini_batch_size: int, seed: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(epoch, rows_M) of each optimizer step over this rank's n rows: `epochs` passes, each cut into
    mini-batches of mini_batch_size / world rows (0: the whole batch), shuffled a group at a time when there is
    more than one step. The same seed gives the same mini-batches: the critic trains on the actor's."""
    mb_local = (mini_batch_size or n * D.world_size()) // D.world_size()
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        shuffle = epochs > 1 or mb_local < n
        order = shuffled_rows(n, group_size, gen) if shuffle else torch.arange(n)
        for m0 in range(0, n, mb_local):
            yield epoch, order[m0 : m0 + mb_local]


def _mini_batch(
    policy,
    optimizer,
    scheduler,
    batch: TrainBatch,
    rows_M: torch.Tensor,
    ends: list[int],
    settings: UpdateSettings,
    kl_coef: float,
    first_epoch: bool,
    acc: MeanAccumulator,
) -> None:
    """One optimizer step over the mini-batch `rows_M` (gradients accumulated over its micro-batches)."""
    algo, W = settings.algo, D.world_size()
    denom = global_normalizer(batch, rows_M, algo.loss_agg)
    # Gradients of the last mini-batch stay until the phase switch frees them on the
    # way to ROLLOUT, so the memory ledger sees them in TRAIN.
    optimizer.zero_grad(set_to_none=True)
    mini_loss = torch.zeros((), device=batch.ids_NL.device)
    for micro in mini_batch_micros(batch, rows_M, ends, settings):
        loss = _micro_batch_loss(
            policy, batch, torch.tensor(micro, device=batch.ids_NL.device), settings, kl_coef, denom, first_epoch, acc
        )
        (loss * W).backward()
        mini_loss = mini_loss + loss.detach()
    # Each rank holds its share of the mini-batch loss; the shares sum to the total.
    acc.add("actor/loss", mini_loss, 1.0 / W)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), settings.grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    # Host sync, on purpose: a non-finite step must stop before it reaches the weights.
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"gradient norm is {grad_norm.item()}; lower optim.lr or check the reward scale")
    acc.add("actor/lr", optimizer.param_groups[0]["lr"])  # the lr this update uses
    optimizer.step()
    scheduler.step()
    acc.add("actor/grad_norm", grad_norm)


def _micro_batch_loss(
    policy,
    batch: TrainBatch,
    rows: torch.Tensor,
    settings: UpdateSettings,
    kl_coef: float,
    denom: float,
    first_epoch: bool,
    acc: MeanAccumulator,
) -> torch.Tensor:
    """The micro-batch `rows`' share of the mini-batch loss (global normaliser `denom`); its metrics into acc."""
    algo = settings.algo
    ids, attn, mask, T = trimmed(batch, rows)
    logp, ent = logprob_function(settings.packing)(policy, ids, attn, batch.P, settings.temperature)
    # On-policy: no scoring forward ran; the policy being updated generated the batch.
    old = batch.old_logp_NT[rows, :T] if batch.old_logp_NT is not None else logp.detach()
    ref = batch.ref_logp_NT[rows, :T] if batch.ref_logp_NT is not None else None
    n_tok = mask.sum()
    if first_epoch:
        acc |= _behaviour_metrics(old, ref, batch, rows, mask, T, algo.kl_estimator)
    weight = batch.weight_NT[rows, :T] if batch.weight_NT is not None else None
    clip_low, clip_high = algo.clip_bounds()
    loss_NT, pm = compute_policy_loss(
        algo.policy_loss,
        logp,
        old,
        batch.adv_NT[rows, :T],
        mask,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        clip_ratio_c=algo.clip_ratio_c,
        weight_NT=weight,
    )
    if algo.kl_placement == "loss" and kl_coef > 0:
        kl_NT = kl_estimate(logp, ref, algo.kl_estimator, mask_NT=mask)
        loss_NT = loss_NT + kl_coef * kl_NT
        acc.add("actor/kl_loss", masked_sum(kl_NT.detach(), mask), n_tok)
    if algo.entropy_coef > 0:
        loss_NT = loss_NT - algo.entropy_coef * ent
    acc.add("actor/entropy", masked_sum(ent.detach(), mask), n_tok)
    for k, v in pm.items():
        if k == "ratio_max":  # the step's extremes, not a mean of micro-batch extremes
            acc.add_max(f"actor/{k}", torch.where(n_tok > 0, v, float("-inf")))
        elif k == "ratio_min":
            acc.add_min(f"actor/{k}", torch.where(n_tok > 0, v, float("inf")))
        else:
            acc.add(f"actor/{k}", v * n_tok, n_tok)
    return aggregate_loss(loss_NT, mask, algo.loss_agg, denom, norm_length=settings.norm_length)


def _behaviour_metrics(old_NT, ref_NT, batch: TrainBatch, rows, mask_NT, T: int, kl_estimator: str) -> MeanAccumulator:
    """Measured on the policy that generated the batch: its log-probs vs the engine's and vs the reference."""
    acc = MeanAccumulator()
    n_tok = mask_NT.sum()
    if batch.engine_logp_NT is not None:
        acc.add("rollout/logp_mismatch", masked_sum((old_NT - batch.engine_logp_NT[rows, :T]).abs(), mask_NT), n_tok)
    if ref_NT is not None:
        acc.add("actor/kl_ref", masked_sum(kl_estimate(old_NT, ref_NT, kl_estimator, mask_NT=mask_NT), mask_NT), n_tok)
    return acc
