"""The batches one step carries from ROLLOUT to TRAIN, this rank's share of them.

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
advantages and the log-probs SCORE computed, all the update (update.py) reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybrid_rl.rollout.base import Completion


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
    def build(cls, rows: list[dict], prompt_ids: list[list[int]], completions: list[Completion], group_size: int,
              rewards_N: torch.Tensor, scores_N: torch.Tensor, pad_id: int, device: torch.device,
              loss_masks: Optional[list[list[int]]] = None) -> "RolloutBatch":
        """Pad on the host in one pass, then one copy per tensor to `device`.

        loss_masks: per completion, 1 for each token the loss may train (sampled by the engine) and 0 for one it
        must not (an episode's observation tokens, rollout/episodes.py); None: every response token."""
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
                raise ValueError(f"completion {i}: a loss mask of 0/1 per token is needed ({len(c.token_ids)} tokens, "
                                 f"mask of {len(loss_masks[i])})")
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
        return cls(rows=rows, prompt_ids=prompt_ids, completions=completions, group_size=G,
                   ids_NL=torch.tensor(ids, dtype=torch.long, device=device), attn_NL=attn_NL,
                   resp_mask_NT=torch.tensor(mask, dtype=torch.float32, device=device), P=P,
                   engine_logp_NT=torch.tensor(logp, dtype=torch.float32, device=device),
                   truncated_N=torch.tensor(truncated, dtype=torch.bool, device=device),
                   rewards_N=rewards_N.to(device), scores_N=scores_N.to(device))


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
