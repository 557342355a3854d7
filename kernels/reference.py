"""Plain-torch reference for per-token log-probability and softmax entropy.

This is the CPU path of `hybrid_rl.kernels.logprob_entropy` and the oracle the
Triton kernel (`kernels/logprob.py`) is tested against. It materialises
log_softmax(logits) of shape (R, V) in fp32, which is exactly what the fused
kernel avoids; use it where memory is not the constraint (CPU, tests, small V).

Shapes legend:
    R: rows (tokens; any leading dims are flattened into R)
    V: vocabulary size
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_logprob_entropy_ref"]


def token_logprob_entropy_ref(logits_RV: Tensor, targets_R: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probability of `targets` and entropy of softmax(logits / temperature).

    Args:
        logits_RV: (..., V) fp32/bf16/fp16 logits.
        targets_R: (...) integer token ids in [0, V), same leading shape.
        temperature: softmax temperature (> 0); logits are divided by it.

    Returns:
        (logp_R, entropy_R): fp32 tensors with the leading shape of `targets_R`.
        Differentiable w.r.t. `logits_RV` through ordinary autograd.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_RV.shape[:-1] != targets_R.shape:
        raise ValueError(f"leading shape mismatch: logits {tuple(logits_RV.shape)} vs targets {tuple(targets_R.shape)}")
    # Upcast first: bf16 log_softmax loses ~3 significant digits, which is visible
    # in the importance ratios exp(logp_new - logp_old) that RL losses build.
    z_RV = logits_RV.float()
    if temperature != 1.0:
        z_RV = z_RV / temperature
    logp_all_RV = torch.log_softmax(z_RV, dim=-1)
    logp_R = logp_all_RV.gather(-1, targets_R.long().unsqueeze(-1)).squeeze(-1)
    p_RV = logp_all_RV.exp()
    # -inf logits (masked vocab) give p = 0 and logp = -inf, and 0 * -inf is NaN.
    # Zero logp wherever p == 0 (their true contribution is 0 or below fp32
    # resolution). masked_fill also zeroes the gradient there; a finite floor
    # such as finfo.min would not do: upstream * floor overflows to inf in the
    # backward and inf * p = inf * 0 is NaN again.
    safe_logp_RV = logp_all_RV.masked_fill(p_RV == 0, 0.0)
    # -sum p log p from the max-shifted log_softmax (torch subtracts the max before
    # the logsumexp) stays accurate for logits of magnitude 1e4, where the
    # algebraically equal lse - sum p z cancels catastrophically in fp32.
    entropy_R = -(p_RV * safe_logp_RV).sum(dim=-1)
    return logp_R, entropy_R
