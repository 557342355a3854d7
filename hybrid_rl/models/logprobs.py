"""Sequence layout and per-token log-probabilities of responses under a policy.

Legend: N sequences, P prompt tokens (left-padded), T response tokens (right-padded),
L = P + T, V vocab.

Layout shared by the rollout engine and the trainer, so both see the same
positions and masks:  [pad .. pad prompt | response pad .. pad].
"""
from __future__ import annotations

from typing import Sequence

import torch

from hybrid_rl.kernels import logprob_entropy


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned to the longest one: ids_NP and attn_NP (1 = real token)."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p):] = 1
    if device is not None:
        ids, attn = ids.to(device), attn.to(device)
    return ids, attn


def build_sequences(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Returns ids_NL, attn_NL (1 = real token), resp_mask_NT (1 = response token), P."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt cannot be scored: every prompt needs at least one token")
    T = max(1, max((len(r) for r in responses), default=1))
    prompt_ids, prompt_attn = left_pad(prompts, pad_id)
    P = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids, torch.full((len(prompts), T), pad_id, dtype=torch.long)], dim=1)
    attn = torch.cat([prompt_attn, torch.zeros((len(prompts), T), dtype=torch.long)], dim=1)
    for i, r in enumerate(responses):
        if r:
            ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
            attn[i, P:P + len(r)] = 1
    resp_mask = attn[:, P:].clone()
    if device is not None:
        ids, attn, resp_mask = ids.to(device), attn.to(device), resp_mask.to(device)
    return ids, attn, resp_mask, P


def position_ids(attn_NL: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so a left-padded prompt starts at position 0."""
    return (attn_NL.cumsum(-1) - 1).clamp(min=0)


def response_logprobs(
    model: torch.nn.Module,
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_NT and entropy_NT of the response tokens under `model` at `temperature`.

    The logits at position P-1+t predict response token t. The temperature matches
    the sampler's, so these are comparable to the engine's sampled-token logprobs.
    """
    if ids_NL.shape != attn_NL.shape or ids_NL.dim() != 2:
        raise ValueError(f"ids {tuple(ids_NL.shape)} and attention mask {tuple(attn_NL.shape)} must be the same (N, L)")
    N, L = ids_NL.shape
    T = L - P
    # Only the last T+1 positions go through the LM head: prompt logits are never needed.
    out = model(input_ids=ids_NL, attention_mask=attn_NL, position_ids=position_ids(attn_NL),
                use_cache=False, logits_to_keep=T + 1)
    logits_NTV = out.logits[:, :-1, :].float()
    V = logits_NTV.shape[-1]
    logp, ent = logprob_entropy(logits_NTV.reshape(N * T, V), ids_NL[:, P:].reshape(N * T), temperature)
    return logp.view(N, T), ent.view(N, T)
