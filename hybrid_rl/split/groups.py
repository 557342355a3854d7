"""Received groups -> the RolloutBatch the colocated SCORE / ADVANTAGE / TRAIN stages take.

Why a batch and not a new type: the learner runs the colocated code unchanged (issue 27 part 4), and
that code reads a RolloutBatch. The batch's `engine_logp_NT` is built from the completions' log-probs,
which in split mode are the generating engine's, token by token, under the version that made each
token: the behaviour policy `stale_samples=correct` hands to the rollout correction.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybrid_rl.batch import RolloutBatch
from hybrid_rl.split.staleness import VersionedGroup


def to_rollout_batch(
    groups: Sequence[VersionedGroup], rows: Sequence[dict], pad_id: int, device: torch.device
) -> RolloutBatch:
    """One batch of `groups` (each of the same G) in order; rows: the dataset, indexed by a group's row_index."""
    if not groups:
        raise ValueError("no groups to batch")
    G = len(groups[0].completions)
    if any(len(g.completions) != G for g in groups):
        raise ValueError(
            f"groups of different sizes {sorted({len(g.completions) for g in groups})}: rollout.n "
            "must be the same on every rollout rank"
        )
    completions = [c for g in groups for c in g.completions]
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    scores = torch.tensor([s for g in groups for s in g.scores], dtype=torch.float32)
    return RolloutBatch.build(
        [rows[g.row_index] for g in groups],
        [g.prompt_ids for g in groups],
        completions,
        G,
        rewards,
        scores,
        pad_id,
        device,
    )


def token_versions_NT(groups: Sequence[VersionedGroup], T: int) -> torch.Tensor:
    """(N, T) version of each response token (-1 on padding), row-major like the batch: what the lag metrics
    of partial rollouts read."""
    rows = []
    for g in groups:
        for i in range(len(g.completions)):
            vs = g.versions_of(i)[:T]
            rows.append(vs + [-1] * (T - len(vs)))
    return torch.tensor(rows, dtype=torch.long)
