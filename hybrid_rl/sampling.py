"""Collect a step's groups of completions, with DAPO dynamic sampling.

Legend: B prompts (groups) on this rank, G samples per prompt, N = B*G sequences.

Without dynamic sampling this is one round: this rank's prompts, G samples each,
their rewards. With it (Yu et al. 2025, "DAPO", arXiv:2503.14476, Sec. 3.2),
groups whose scores are all equal (all right or all wrong: zero advantage, no
gradient) are dropped and new prompts are drawn and generated, round after
round, until this rank holds its B informative groups or `max_rounds` rounds
have run. Then the step trains on what it has: never on the dropped groups.

Rank agreement. A training micro-batch forward is a collective under FSDP, so
every rank must train on the same number of rows, and the prompt loaders must
stay in step (same number of draws per step) so the data order stays the one a
resumed run would see. So:
  * after each round the ranks all-reduce "does any rank still need groups";
    while one does (and rounds remain) every rank runs another round, a rank
    that is already full included (its extra groups are surplus);
  * at the end they all-reduce the MIN of kept groups and every rank truncates
    to it (each rank keeps its first K informative groups).
Both are a single small all-reduce; on one rank they are no-ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from hybrid_rl import distributed as D
from hybrid_rl.algorithms.dapo import filter_groups
from hybrid_rl.rollout.base import Completion

# next_rows() -> this rank's next prompts; generate(rows, round) -> G completions per row, row-major;
# score(rows, completions) -> (rewards_N, scores_N): the task reward and the score the advantage uses.
NextRows = Callable[[], list[dict]]
Generate = Callable[[list[dict], int], list[Completion]]
Score = Callable[[list[dict], list[Completion]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SampledGroups:
    """The groups this rank trains on, plus every completion generated (for unbiased reward metrics)."""

    rows: list[dict]
    completions: list[Completion]  # len(rows) * G, row-major
    rewards_N: torch.Tensor  # task reward of the kept completions
    scores_N: torch.Tensor  # reward + shaping (overlong penalty): what the filter and the advantage see
    all_rewards_N: torch.Tensor  # task reward of every completion generated this step
    all_completions: list[Completion] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _min_over_ranks(value: int) -> int:
    return int(-D.all_reduce_max(torch.tensor([-value], dtype=torch.int64)).item())


def _any_rank(flag: bool) -> bool:
    return bool(D.all_reduce_max(torch.tensor([int(flag)], dtype=torch.int64)).item())


def sample_groups(next_rows: NextRows, generate: Generate, score: Score, group_size: int,
                  dynamic: bool, max_rounds: int) -> SampledGroups:
    """Generate and score groups; with `dynamic`, keep only groups whose scores differ (see module doc).

    Every rank must call this together (it runs collectives when distributed).
    metrics (global over ranks): sampling/rounds, sampling/groups_generated,
    sampling/groups_filtered (all-equal, dropped), sampling/groups_surplus (informative
    but beyond the batch or cut for rank agreement), sampling/groups_kept, sampling/batch_fill
    (kept / requested).
    """
    if group_size < 1 or max_rounds < 1:
        raise ValueError(f"group_size and max_rounds must be >= 1, got {group_size}, {max_rounds}")
    G = group_size
    want = 0
    kept: list[tuple[dict, list[Completion], torch.Tensor, torch.Tensor]] = []
    all_rewards: list[torch.Tensor] = []
    all_completions: list[Completion] = []
    generated = filtered = rounds = 0
    while True:
        rows = next_rows()
        want = want or len(rows)
        completions = generate(rows, rounds)
        rounds += 1
        if len(completions) != len(rows) * G:
            raise RuntimeError(f"engine returned {len(completions)} completions for {len(rows)} prompts x {G}")
        rewards_N, scores_N = score(rows, completions)
        all_rewards.append(rewards_N)
        all_completions += completions
        generated += len(rows)
        group_ids_N = torch.arange(len(completions)) // G
        keep_B = filter_groups(scores_N, group_ids_N).view(-1, G)[:, 0] if dynamic else torch.ones(len(rows), dtype=torch.bool)
        filtered += int((~keep_B).sum())
        for b in keep_B.nonzero().flatten().tolist():
            kept.append((rows[b], completions[b * G:(b + 1) * G], rewards_N[b * G:(b + 1) * G], scores_N[b * G:(b + 1) * G]))
        if not dynamic or rounds >= max_rounds or not _any_rank(len(kept) < want):
            break

    K = _min_over_ranks(min(len(kept), want))
    surplus = len(kept) - K
    kept = kept[:K]
    totals = D.all_reduce_sum(torch.tensor([generated, filtered, surplus, K, want], dtype=torch.float64))
    metrics = {"sampling/rounds": float(rounds), "sampling/groups_generated": totals[0].item(),
               "sampling/groups_filtered": totals[1].item(), "sampling/groups_surplus": totals[2].item(),
               "sampling/groups_kept": totals[3].item(), "sampling/batch_fill": (totals[3] / totals[4]).item()}
    return SampledGroups(
        rows=[k[0] for k in kept],
        completions=[c for k in kept for c in k[1]],
        rewards_N=torch.cat([k[2] for k in kept]) if kept else torch.zeros(0),
        scores_N=torch.cat([k[3] for k in kept]) if kept else torch.zeros(0),
        all_rewards_N=torch.cat(all_rewards),
        all_completions=all_completions,
        metrics=metrics,
    )
