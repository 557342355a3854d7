"""Sequence layout and per-token log-probabilities of responses under a policy.

Legend: N sequences, P prompt tokens (left-padded), T response tokens (right-padded),
L = P + T, V vocab, H hidden size.

Layout shared by the rollout engine and the trainer, so both see the same
positions and masks:  [pad .. pad prompt | response pad .. pad].
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

from hybrid_rl.kernels import chunked_logprob_entropy


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned to the longest one: ids_NP and attn_NP (1 = real token)."""
    P = max(len(p) for p in prompts)
    # One tensor from padded Python lists: a torch.tensor per row costs more than the copy.
    ids = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long)
    attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    if device is not None:
        ids, attn = ids.to(device), attn.to(device)
    return ids, attn


def build_sequences(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Returns ids_NL, attn_NL (1 = real token), resp_mask_NT (1 = response token), P."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt cannot be scored: every prompt needs at least one token")
    T = max(1, max((len(r) for r in responses), default=1))
    prompt_ids, prompt_attn = left_pad(prompts, pad_id)
    P = prompt_ids.shape[1]
    resp_ids = torch.tensor([list(r) + [pad_id] * (T - len(r)) for r in responses], dtype=torch.long)
    resp_attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses], dtype=torch.long)
    ids = torch.cat([prompt_ids, resp_ids], dim=1)
    attn = torch.cat([prompt_attn, resp_attn], dim=1)
    resp_mask = attn[:, P:].clone()
    if device is not None:
        ids, attn, resp_mask = ids.to(device), attn.to(device), resp_mask.to(device)
    return ids, attn, resp_mask, P


def position_ids(attn_NL: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so a left-padded prompt starts at position 0."""
    return (attn_NL.cumsum(-1) - 1).clamp(min=0)


def _is_dtensor(x: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed has no DTensor either
        return False
    return isinstance(x, DTensor)


@contextlib.contextmanager
def _head_replaced(head: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """`head(x)` runs `forward(x)` instead, for the duration of the block.

    An instance attribute shadows the class's forward, so the module object, its
    parameters and any hooks on it stay as they are.
    """
    shadowed = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if shadowed is None:
            del head.forward
        else:
            head.forward = shadowed


def check_layout(ids_NL: torch.Tensor, attn_NL: torch.Tensor, P: int) -> tuple[int, int]:
    """(N, T) of a scored batch; raises unless ids and mask are one (N, L) shape with P, T >= 1."""
    if ids_NL.shape != attn_NL.shape or ids_NL.dim() != 2:
        raise ValueError(f"ids {tuple(ids_NL.shape)} and attention mask {tuple(attn_NL.shape)} must be the same (N, L)")
    N, L = ids_NL.shape
    if L - P < 1 or P < 1:
        raise ValueError(f"need P >= 1 prompt and T >= 1 response columns, got P={P} for L={L}")
    return N, L - P


def scatter_responses(
    values_Q: Sequence[torch.Tensor], row_Q: torch.Tensor, col_Q: torch.Tensor, N: int, T: int
) -> tuple[torch.Tensor, ...]:
    """Each per-token vector (Q,) of the scored response tokens back in the padded (N, T) layout, 0 elsewhere."""
    return tuple(torch.zeros((N, T), dtype=v.dtype, device=v.device).index_put((row_Q, col_Q), v) for v in values_Q)


def response_logprobs(
    model: torch.nn.Module,
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_NT and entropy_NT (fp32) of the response tokens under `model` at `temperature`.

    The logits at position P-1+t predict response token t. The temperature matches
    the sampler's, so these are comparable to the engine's sampled-token logprobs.
    Every column is computed, padding included (`models.packing` skips the padding).
    """
    N, T = check_layout(ids_NL, attn_NL, P)

    def select(hidden_NKH: torch.Tensor) -> torch.Tensor:
        # K = T + 1 kept positions: the last one predicts past the response.
        return hidden_NKH[:, :-1].reshape(N * T, hidden_NKH.shape[-1])

    # Only the last T+1 positions reach the head: prompt positions are never scored.
    logp_R, ent_R = head_logprobs(
        model,
        select,
        ids_NL[:, P:].reshape(N * T),
        temperature,
        chunk_tokens,
        input_ids=ids_NL,
        attention_mask=attn_NL,
        position_ids=position_ids(attn_NL),
        logits_to_keep=T + 1,
    )
    return logp_R.view(N, T).contiguous(), ent_R.view(N, T).contiguous()


def head_logprobs(
    model: torch.nn.Module,
    select: Callable[[torch.Tensor], torch.Tensor],
    targets_R: torch.Tensor,
    temperature: float,
    chunk_tokens: int | None,
    **model_inputs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_R and entropy_R (fp32) of `targets_R`, predicted by the hidden states `select` picks (R rows, H).

    No (R, V) logits exist at any time, in the forward or the backward: the LM head
    is folded into `chunked_logprob_entropy`, which builds chunk_tokens rows of logits
    at a time (None: `chunk_rows`, at least four chunks for a large R, each at most
    256 MiB of fp32) and rebuilds them in the backward. Gradients reach the hidden
    states and the head's weight (and bias), so a tied embedding gets both of its
    contributions.
    """
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None) is not None:
        raise NotImplementedError("the chunked LM head does not apply final_logit_softcapping")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"expected the model's output embedding to be an nn.Linear LM head, got {type(head).__name__}")

    # The head runs inside the model's own forward, so the weight it reads is the one
    # the forward sees: under FSDP2 the root module (which owns lm_head and, when
    # tied, embed_tokens) has all-gathered it in its pre-forward hook, and the weight
    # saved for the backward is that unsharded parameter, whose grad FSDP2
    # reduce-scatters, exactly as for nn.Linear. Outside the forward it would be a
    # sharded DTensor. The (1, R, 2) result stands in for the logits so that FSDP2's
    # pre-backward hook on the model's outputs fires before our backward.
    def logp_and_entropy(hidden: torch.Tensor) -> torch.Tensor:
        weight_VH = head.weight
        if _is_dtensor(weight_VH):
            raise RuntimeError(
                "lm_head.weight is still sharded inside the model's forward: "
                "fully_shard the root module (models/fsdp.py), not the head on its own with another mesh"
            )
        logp_R, ent_R = chunked_logprob_entropy(
            select(hidden), weight_VH, head.bias, targets_R, temperature, chunk_tokens
        )
        # Stacked from (1, R) pieces, not stacked then unsqueezed: the model returns this tensor, and FSDP2 warns
        # about a root output that is a view (an in-place op on it would skip the pre-backward hook).
        return torch.stack([logp_R[None], ent_R[None]], dim=-1)

    with _head_replaced(head, logp_and_entropy):
        out = model(**model_inputs, use_cache=False)
    both_1R2 = out.logits
    R = targets_R.shape[0]
    assert both_1R2.shape == (1, R, 2), f"the model transformed the head's output: {tuple(both_1R2.shape)}"
    return both_1R2[0, :, 0], both_1R2[0, :, 1]
