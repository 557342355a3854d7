"""One policy update over a rollout batch: epochs x mini-batches x micro-batches.

Legend: N sequences on this rank, L = P + T tokens (P prompt, T response).

The loss normaliser of a mini-batch is global (summed over its micro-batches and
over ranks) so gradient accumulation and data parallelism give the gradient of
one big batch. FSDP2 averages gradients over ranks; the loss is multiplied by the
world size to turn that average back into the sum the normaliser expects.

Old-policy log-probs are computed once per step, before the first epoch
(`score_logprobs` in the trainer), so every epoch and mini-batch measures its
ratio against the policy that generated the batch. When the update is on-policy
(`is_on_policy`: one epoch, one mini-batch) that scoring pass is skipped: the
update's own forward, detached, is the old policy.
Per-token loss: policy loss (x the rollout-correction weight) + kl_coef x KL to
the reference (when the KL is placed in the loss) - entropy_coef x entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_rl import distributed as D
from hybrid_rl.algorithms.aggregation import aggregate_loss, masked_sum, normalizer_count
from hybrid_rl.algorithms.kl import kl_estimate
from hybrid_rl.algorithms.losses import compute_policy_loss
from hybrid_rl.config import AlgorithmConfig
from hybrid_rl.metrics import MeanAccumulator
from hybrid_rl.models.logprobs import response_logprobs


@dataclass
class RolloutBatch:
    """This rank's sequences with everything the loss needs (all on the compute device)."""

    ids_NL: torch.Tensor
    attn_NL: torch.Tensor
    mask_NT: torch.Tensor  # float, 1 = response token in the loss
    P: int
    old_logp_NT: torch.Tensor | None  # None: on-policy, the update's own forward is the old policy
    adv_N: torch.Tensor
    ref_logp_NT: torch.Tensor | None = None
    weight_NT: torch.Tensor | None = None  # rollout-correction importance weight (TIS), detached
    engine_logp_NT: torch.Tensor | None = None  # for the mismatch metric when old_logp_NT is None

    def __len__(self) -> int:
        return self.ids_NL.shape[0]


def trimmed(b: RolloutBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of the batch cut to their longest response (padding columns cost compute)."""
    mask = b.mask_NT[rows]
    T = int(mask.sum(0).nonzero().max().item()) + 1 if mask.any() else 1
    return b.ids_NL[rows, :b.P + T], b.attn_NL[rows, :b.P + T], mask[:, :T]


def is_on_policy(algo: AlgorithmConfig, n_global: int) -> bool:
    """One epoch over one mini-batch: the policy that takes the step is the one that generated
    the batch, so the old log-probs equal the update's own (detached) log-probs."""
    return algo.ppo_epochs == 1 and algo.mini_batch_size in (0, n_global)


@torch.no_grad()
def score_logprobs(model: torch.nn.Module, ids_NL: torch.Tensor, attn_NL: torch.Tensor, P: int,
                   temperature: float, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_NT, entropy_NT of the response tokens, micro-batched; no gradients."""
    logps, ents = [], []
    for s in range(0, ids_NL.shape[0], micro_batch_size):
        lp, ent = response_logprobs(model, ids_NL[s:s + micro_batch_size], attn_NL[s:s + micro_batch_size], P, temperature)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def policy_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: RolloutBatch,
    algo: AlgorithmConfig,
    temperature: float,
    micro_batch_size: int,
    grad_clip: float,
    norm_length: int,
    seed: int,
    kl_coef: float | None = None,
) -> dict[str, float]:
    """Epochs x mini-batches x micro-batches of `batch`; returns the update's metrics (reduced over ranks).

    kl_coef: the KL coefficient for this step (a controller's value); None means algo.kl_coef.
    Every rank must hold the same number of rows: each micro-batch forward is a collective.
    """
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
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(len(batch), generator=gen) if (algo.ppo_epochs > 1 or mb_local < len(batch)) else torch.arange(len(batch))
        for m0 in range(0, len(batch), mb_local):
            mini = order[m0:m0 + mb_local].to(batch.ids_NL.device)
            local_norm = normalizer_count(batch.mask_NT[mini], algo.loss_agg)
            denom = D.all_reduce_sum(torch.tensor([local_norm], dtype=torch.float64)).item()
            mini_loss = 0.0
            # Gradients of the last mini-batch stay until the phase switch frees them on the
            # way to ROLLOUT, so the memory ledger sees them in TRAIN.
            optimizer.zero_grad(set_to_none=True)
            for u0 in range(0, len(mini), micro_batch_size):
                rows = mini[u0:u0 + micro_batch_size]
                ids, attn, mask = trimmed(batch, rows)
                T = mask.shape[1]
                logp, ent = response_logprobs(policy, ids, attn, batch.P, temperature)
                weight = batch.weight_NT[rows, :T] if batch.weight_NT is not None else None
                if batch.old_logp_NT is not None:
                    old = batch.old_logp_NT[rows, :T]
                else:
                    # On-policy: no separate scoring forward; ratio 1, gradient of logp (the same step).
                    old = logp.detach()
                    if batch.engine_logp_NT is not None:
                        acc.add("rollout/logp_mismatch", float(masked_sum((old - batch.engine_logp_NT[rows, :T]).abs(), mask)),
                                float(mask.sum().item()))
                loss_NT, pm = compute_policy_loss(
                    algo.policy_loss, logp, old, batch.adv_N[rows], mask,
                    clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=algo.clip_ratio_c, weight_NT=weight)
                n_tok = float(mask.sum().item())
                if kl_in_loss:
                    kl_NT = kl_estimate(logp, batch.ref_logp_NT[rows, :T], algo.kl_estimator, mask_NT=mask)
                    loss_NT = loss_NT + kl_coef * kl_NT
                    acc.add("actor/kl_loss", float(masked_sum(kl_NT.detach(), mask)), n_tok)
                if algo.entropy_coef > 0:
                    loss_NT = loss_NT - algo.entropy_coef * ent
                acc.add("actor/entropy_train", float(masked_sum(ent.detach(), mask)), n_tok)
                loss = aggregate_loss(loss_NT, mask, algo.loss_agg, denom, norm_length=norm_length)
                (loss * W).backward()
                mini_loss += loss.item()
                for k, v in pm.items():
                    acc.add(f"actor/{k}", float(v) * n_tok, n_tok)
            acc.add("actor/loss", mini_loss * W)  # every rank adds W x its share: the mean is the total
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            if not torch.isfinite(grad_norm):
                raise FloatingPointError(f"gradient norm is {grad_norm.item()}; lower optim.lr or check the reward scale")
            optimizer.step()
            scheduler.step()
            acc.add("actor/grad_norm", grad_norm.item())
            acc.add("actor/lr", scheduler.get_last_lr()[0])
    return acc.reduce()
