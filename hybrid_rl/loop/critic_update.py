"""The critic's part of a PPO step: its values in SCORE, its update in TRAIN (issue 36).

Legend: N sequences on this rank, T response tokens.

SCORE runs `score_values`: V of the state before each response token (models/value.py, the log-probs'
(N, T) layout), no gradients, in the update's micro-batches. ADVANTAGE turns them and the token rewards into
GAE advantages and returns (algorithms/gae.py). TRAIN runs `critic_update` over the SAME mini-batches as the
actor's `policy_update` (the same rows in the same order: `loop.update.mini_batch_rows` with the same seed),
each an optimizer step of the clipped value loss, aggregated like the policy loss (its mode, its global
normaliser over micro-batches and ranks). The critic runs the actor's forward layout (`value_function`): with
trainer.packing its padding-free twin (models/value.py packed_response_values: each distinct prompt once, as the
actor's packed log-probs), else padded, and its micro-batches are cut as the actor's (the same `packed` rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_rl.algorithms.aggregation import masked_sum
from hybrid_rl.algorithms.gae import value_loss
from hybrid_rl.batch import TrainBatch, response_ends, trimmed
from hybrid_rl.config.schema import Config
from hybrid_rl.loop.update import (
    global_normalizer,
    mini_batch_micros,
    mini_batch_rows,
    per_token_in_micro_batches,
    train_mode,
)
from hybrid_rl.models.value import packed_response_values, response_values
from hybrid_rl.observability.metrics import MeanAccumulator
from hybrid_rl.runtime import distributed as D


@dataclass(frozen=True)
class CriticSettings:
    """What the critic's update reads from the config, gathered once."""

    cliprange_value: float | None  # critic.cliprange_value; None: no clip
    grad_clip: float
    loss_agg: str  # algorithm.loss_agg: the value loss aggregates as the policy loss does
    norm_length: int  # rollout.max_new_tokens, for the length-normalised aggregations
    ppo_epochs: int
    mini_batch_size: int  # sequences over all ranks; 0 = the whole batch
    micro_batch_size: int
    max_tokens_per_micro_batch: int = 0
    packing: bool = False  # trainer.packing: the actor's padding-free forward and micro-batch cut

    @classmethod
    def from_config(cls, cfg: Config) -> "CriticSettings":
        c, a, t = cfg.critic, cfg.algorithm, cfg.trainer
        return cls(
            cliprange_value=c.cliprange_value,
            grad_clip=c.grad_clip,
            loss_agg=a.loss_agg,
            norm_length=cfg.rollout.max_new_tokens,
            ppo_epochs=a.ppo_epochs,
            mini_batch_size=a.mini_batch_size,
            micro_batch_size=t.micro_batch_size,
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            packing=t.packing,
        )


def value_function(packing: bool):
    """The forward that gives a micro-batch's values: padding-free (`packed_response_values`) or padded, the
    actor's choice (`loop.update.logprob_function`)."""
    return packed_response_values if packing else response_values


@torch.no_grad()
def score_values(
    critic: torch.nn.Module,
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    micro_batch_size: int,
    max_tokens: int = 0,
    group_size: int = 1,
    packing: bool = False,
) -> torch.Tensor:
    """values_NT (float32, 0 on padding) of the rollout's response tokens under `critic`, in micro-batches cut
    as the update's (rows by a row count or a token budget, each trimmed to its longest response); packing: the
    padding-free forward (`value_function`)."""
    forward = value_function(packing=packing)
    return per_token_in_micro_batches(
        lambda ids, attn: forward(critic, ids, attn, P),
        ids_NL,
        attn_NL,
        P,
        micro_batch_size,
        max_tokens,
        packing,
        group_size,
    )


def critic_update(
    *,
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: TrainBatch,
    settings: CriticSettings,
    seed: int,
) -> dict[str, float]:
    """Epochs x mini-batches x micro-batches of the clipped value loss over `batch` (its `values_NT`, the
    critic's values in SCORE, and `returns_NT`, GAE's); returns critic/* metrics reduced over ranks. `seed` is
    the step's shuffle seed, the one `policy_update` got: both see the same mini-batches."""
    if batch.values_NT is None or batch.returns_NT is None:
        raise ValueError("critic_update needs the batch's values_NT and returns_NT (algorithm.advantage=gae)")
    W = D.world_size()
    acc = MeanAccumulator()
    ends = response_ends(batch.mask_NT)
    forward = value_function(packing=settings.packing)
    with train_mode(critic):
        for _, rows_M in mini_batch_rows(
            len(batch), batch.group_size, settings.ppo_epochs, settings.mini_batch_size, seed
        ):
            denom = global_normalizer(batch, rows_M, settings.loss_agg)
            optimizer.zero_grad(set_to_none=True)
            mini_loss = torch.zeros((), device=batch.ids_NL.device)
            for micro in mini_batch_micros(batch, rows_M, ends, settings):
                rows = torch.tensor(micro, device=batch.ids_NL.device)
                ids, attn, mask, T = trimmed(batch, rows)
                vpred_NT = forward(critic, ids, attn, batch.P)
                loss, clipfrac = value_loss(
                    vpred_NT,
                    batch.returns_NT[rows, :T],
                    batch.values_NT[rows, :T],
                    mask,
                    settings.cliprange_value,
                    settings.loss_agg,
                    global_normalizer=denom,
                    norm_length=settings.norm_length,
                )
                (loss * W).backward()
                mini_loss = mini_loss + loss.detach()
                n_tok = mask.sum()
                acc.add("critic/vf_clipfrac", clipfrac * n_tok, n_tok)
                acc.add("critic/vpred_mean", masked_sum(vpred_NT.detach(), mask), n_tok)
            acc.add("critic/vf_loss", mini_loss, 1.0 / W)
            grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), settings.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            if not torch.isfinite(grad_norm):  # host sync, on purpose: a NaN value head stops here
                raise FloatingPointError(
                    f"critic gradient norm is {grad_norm.item()}; lower critic.lr or check the reward scale "
                    "(a value head producing NaN)"
                )
            acc.add("critic/lr", optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
            acc.add("critic/grad_norm", grad_norm)
    return acc.reduce()
