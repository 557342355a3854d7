"""Loss aggregation with a global normaliser (gradient-accumulation and DP invariant).

Shape legend:
    N   sequences in this micro-batch (rows)
    T   response tokens (padded)
    _NT per-token tensor, _N per-sequence tensor

Why a global normaliser: a mini-batch is split into micro-batches (gradient
accumulation) and over data-parallel ranks. Averaging per-micro-batch means
weights tokens/sequences differently depending on how the batch was split. We
instead divide every micro-batch's SUM by one number for the whole mini-batch:

    1. each micro-batch computes c = normalizer_count(mask_NT, mode);
    2. the trainer sums c over the micro-batches of the mini-batch and
       all-reduce-sums it over ranks -> global_normalizer;
    3. each micro-batch calls aggregate_loss(..., global_normalizer) and
       backpropagates it.

The per-micro-batch results then SUM (over micro-batches and ranks) to the loss
of the whole mini-batch computed at once, and so do the gradients. If the
data-parallel wrapper AVERAGES gradients over ranks (DDP, FSDP), multiply the
loss by the world size to undo that averaging.

Sequence counting: "seq-*" modes count rows with at least one valid token.
Fully masked rows (padding rows added to balance micro-batches, completions
removed by overlong filtering or masked importance sampling) contribute nothing
to the numerator and are excluded from the denominator too, as verl does.
Pass count_empty_rows=True to count every row instead.

Difference from verl in seq-mean-token-sum-norm: here the token-loss sum is
divided by (number of sequences in the mini-batch) x norm_length, i.e.
(1/G) sum_i sum_t l_it / L_const, Dr. GRPO's objective with a constant length
in place of 1/|y_i|. verl's agg_loss (verl/trainer/ppo/core_algos.py, checked
at commit b178a3c, Jan 2026) divides the micro-batch's token-loss sum by
loss_scale_factor only: actor.loss_scale_factor if set, else
loss_mask.shape[-1], the padded response length of that micro-batch tensor. It
does not divide by the number of sequences; its actor then only multiplies each
micro-batch loss by 1/gradient_accumulation (or by micro-batch rows /
ppo_mini_batch_size with dynamic batch size). The two differ by a constant
factor for a fixed batch size, which the learning rate absorbs, and verl's
default horizon changes with the padding of each micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LOSS_AGG_MODES", "normalizer_count", "aggregate_loss", "masked_sum"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {list(LOSS_AGG_MODES)}")


def _check_mask_NT(mask_NT: Tensor) -> None:
    if not isinstance(mask_NT, Tensor) or mask_NT.dim() != 2:
        raise ValueError(f"mask_NT must be a 2-D (N, T) tensor, got {getattr(mask_NT, 'shape', type(mask_NT))}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask != 0 (masked entries may hold NaN/inf; they are ignored)."""
    if x.shape != mask.shape:
        raise ValueError(f"x and mask must have the same shape, got {tuple(x.shape)} and {tuple(mask.shape)}")
    kept = torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def normalizer_count(mask_NT: Tensor, mode: str, *, count_empty_rows: bool = False) -> float:
    """This micro-batch's contribution to the global normaliser.

    token-mean: number of valid tokens, sum(mask_NT != 0).
    seq-* modes: number of sequences, i.e. rows with at least one valid token
        (every row if count_empty_rows=True).
    The trainer sums this over the micro-batches of a mini-batch and over ranks.

    Args:
        mask_NT: (N, T) response mask (bool or 0/1).
        mode: one of LOSS_AGG_MODES.
    Returns:
        a Python float (an integer value).
    """
    _check_mode(mode)
    _check_mask_NT(mask_NT)
    valid_NT = mask_NT != 0
    if mode == "token-mean":
        return float(valid_NT.sum().item())
    if count_empty_rows:
        return float(mask_NT.shape[0])
    return float(valid_NT.any(dim=1).sum().item())


def aggregate_loss(
    loss_NT: Tensor,
    mask_NT: Tensor,
    mode: str,
    global_normalizer: float | Tensor,
    norm_length: int | None = None,
) -> Tensor:
    """This micro-batch's share of the mini-batch loss (a 0-d tensor).

    With D = global_normalizer (see module docstring), m = mask, |y_i| = sum_t m_it:
        token-mean:              sum_it m_it l_it / D                    (D = #tokens)
        seq-mean-token-sum:      sum_i (sum_t m_it l_it) / D             (D = #seqs)
        seq-mean-token-mean:     sum_i (sum_t m_it l_it / |y_i|) / D     (empty rows add 0)
        seq-mean-token-sum-norm: sum_it m_it l_it / (D * norm_length)    (Dr. GRPO)
    token-mean is the DAPO token-level loss (Yu et al. 2025, arXiv:2503.14476);
    seq-mean-token-mean is the original GRPO objective (Shao et al. 2024);
    seq-mean-token-sum-norm divides by a constant length (Liu et al. 2025,
    "Dr. GRPO", arXiv:2503.20783) and requires norm_length (e.g. the maximum
    response length), which is ignored by the other modes.

    Args:
        loss_NT: (N, T) per-token loss; values at masked positions are ignored.
        mask_NT: (N, T) response mask (bool or 0/1).
        mode: one of LOSS_AGG_MODES.
        global_normalizer: summed normalizer_count over micro-batches and ranks
            (float or 0-d tensor). 0 is allowed only if nothing is valid anywhere.
        norm_length: constant length for seq-mean-token-sum-norm.
    """
    _check_mode(mode)
    _check_mask_NT(mask_NT)
    _check_loss_NT(loss_NT, mask_NT)
    denom, denom_value = _denominator(global_normalizer, mode, norm_length, loss_NT)
    numerator = _numerator(loss_NT, mask_NT, mode)
    return _divide(numerator, denom, denom_value)


def _check_loss_NT(loss_NT: Tensor, mask_NT: Tensor) -> None:
    if not isinstance(loss_NT, Tensor) or loss_NT.shape != mask_NT.shape:
        raise ValueError(
            f"loss_NT must have the same (N, T) shape as mask_NT {tuple(mask_NT.shape)}, "
            f"got {getattr(loss_NT, 'shape', type(loss_NT))}"
        )


def _denominator(
    global_normalizer: float | Tensor, mode: str, norm_length: int | None, loss_NT: Tensor
) -> tuple[float | Tensor, float | None]:
    """The divisor of the numerator: D, times norm_length for seq-mean-token-sum-norm.

    Returns (denom, denom_value): denom is a float, or a 0-d tensor in loss_NT's dtype and
    device when D is a tensor; denom_value is D as a float, or None for a tensor D (reading
    it would sync the device, so a tensor D is not checked for sign).
    """
    if isinstance(global_normalizer, Tensor):
        if global_normalizer.numel() != 1:
            raise ValueError(f"global_normalizer must be a scalar, got shape {tuple(global_normalizer.shape)}")
        denom = global_normalizer.reshape(()).to(device=loss_NT.device, dtype=loss_NT.dtype)
        denom_value = None
    else:
        denom_value = float(global_normalizer)
        denom = denom_value
    if denom_value is not None and denom_value < 0:
        raise ValueError(f"global_normalizer must be >= 0 (a summed count), got {denom_value}")
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(
                "mode 'seq-mean-token-sum-norm' needs norm_length > 0, a constant such as the "
                f"maximum response length; got {norm_length}"
            )
        denom = denom * norm_length
    return denom, denom_value


def _numerator(loss_NT: Tensor, mask_NT: Tensor, mode: str) -> Tensor:
    """The micro-batch's summed loss: sum_i (sum_t m_it l_it / |y_i|) for seq-mean-token-mean
    (an empty row's length counts as 1, so it adds 0), sum_it m_it l_it for every other mode."""
    if mode == "seq-mean-token-mean":
        row_sum_N = masked_sum(loss_NT, mask_NT, dim=1)
        len_N = (mask_NT != 0).sum(dim=1).clamp(min=1).to(row_sum_N.dtype)
        return (row_sum_N / len_N).sum()
    return masked_sum(loss_NT, mask_NT)


def _divide(numerator: Tensor, denom: float | Tensor, denom_value: float | None) -> Tensor:
    """numerator / denom, or 0 when denom is 0.

    A zero normaliser means nothing is valid anywhere, so the numerator is 0 too; return 0
    rather than 0/0 and keep the graph connected so every rank still runs backward (FSDP's
    collectives need that). A tensor denom is tested on the device, without a sync.
    """
    if denom_value is None:
        positive = denom > 0
        return torch.where(positive, numerator / torch.where(positive, denom, torch.ones_like(denom)), numerator * 0.0)
    if denom_value == 0.0:
        return numerator * 0.0
    return numerator / denom
