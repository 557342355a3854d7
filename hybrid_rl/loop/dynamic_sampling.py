"""Which generated groups a step trains on: DAPO dynamic sampling, as bookkeeping.

Legend: B prompts (groups) on this rank, G samples per prompt, N = B*G sequences.

The trainer runs the rounds itself (draw prompts, generate, reward) and hands
each round to a `GroupCollector`, which keeps the groups worth training on and
says whether another round is needed. Without dynamic sampling there is one
round and every group is kept. With it (Yu et al. 2025, "DAPO", arXiv:2503.14476,
Sec. 3.2), groups whose scores are all equal (all right or all wrong: zero
advantage, no gradient) are dropped and new prompts are drawn and generated,
round after round, until this rank holds its B informative groups or `max_rounds`
rounds have run. The step then trains on what it has: never on dropped groups.

Rank agreement. A training micro-batch forward is a collective under FSDP, so
every rank must train on the same number of rows, and the prompt loaders must
stay in step (same number of draws per step), so that the data order depends
only on the step. So:
  * after each round the ranks all-reduce "does any rank still need groups";
    while one does (and rounds remain) every rank runs another round, a rank
    that is already full included (its extra groups are surplus);
  * at the end they all-reduce the MIN of kept groups and every rank truncates
    to it (each rank keeps its first K informative groups).
Both are a single small all-reduce of a host tensor; on one rank they are no-ops.

Reward metrics are taken over every completion generated this step (all rounds),
an unbiased view of the policy, not only over the groups kept. A run whose reward has
parts (rewards/combine.py: rule, model, model_norm) logs each one as
`reward/<part>_mean` and `reward/<part>_std` next to the combined `reward/mean`;
`reward/accuracy` is then the rule reward's (the part the success threshold is for), and
a run on the reward model alone has none (a model's score has no threshold of "correct").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from hybrid_rl.algorithms.dapo import filter_groups
from hybrid_rl.observability.metrics import MeanAccumulator
from hybrid_rl.runtime import distributed as D
from hybrid_rl.types import Completion


@dataclass
class KeptGroups:
    """The groups this rank trains on (row-major: G completions per row)."""

    rows: list[dict]
    prompt_ids: list[list[int]]
    completions: list[Completion]
    rewards_N: torch.Tensor  # task reward
    scores_N: torch.Tensor  # reward + shaping: what the filter and the advantage see


class GroupCollector:
    """Collects sampling rounds; every rank must call `need_another_round` and `finish` together."""

    def __init__(self, group_size: int, dynamic: bool, max_rounds: int, success_threshold: float = 1.0):
        if group_size < 1 or max_rounds < 1:
            raise ValueError(f"group_size and max_rounds must be >= 1, got {group_size}, {max_rounds}")
        self.G, self.dynamic, self.max_rounds = group_size, dynamic, max_rounds
        self.success_threshold = success_threshold
        self.rounds = 0
        self.want = 0  # groups per round = groups the step asks for
        self.generated = self.filtered = 0
        self._kept: list[tuple[dict, list[int], list[Completion], torch.Tensor, torch.Tensor]] = []
        self._seen = MeanAccumulator()  # reward and length over every completion generated

    def add(
        self,
        rows: list[dict],
        prompt_ids: list[list[int]],
        completions: list[Completion],
        rewards_N: torch.Tensor,
        scores_N: torch.Tensor,
        parts: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> None:
        """One round: B rows, their prompt ids, B*G completions and their rewards and scores (host tensors);
        `parts`: the reward's named parts (each (N,)), logged separately; every rank passes the same names."""
        G, B = self.G, len(rows)
        if len(completions) != B * G or len(prompt_ids) != B:
            raise RuntimeError(f"engine returned {len(completions)} completions for {B} prompts x {G}")
        self.rounds += 1
        self.want = self.want or B
        self.generated += B
        self._record(rewards_N, completions, parts or {})
        # Groups whose scores are all equal get zero advantage and no gradient (TRL's frac_reward_zero_std).
        groups_BG = scores_N.view(B, G)
        self._seen.add("reward/frac_zero_std", (groups_BG.amax(1) == groups_BG.amin(1)).sum(), B)
        if self.dynamic:
            keep_B = filter_groups(scores_N, torch.arange(B * G) // G).view(B, G)[:, 0]
        else:
            keep_B = torch.ones(B, dtype=torch.bool)
        self.filtered += int((~keep_B).sum())
        for b in keep_B.nonzero().flatten().tolist():
            s = slice(b * G, (b + 1) * G)
            self._kept.append((rows[b], prompt_ids[b], completions[s], rewards_N[s], scores_N[s]))

    def _record(
        self, rewards_N: torch.Tensor, completions: list[Completion], parts: Mapping[str, torch.Tensor]
    ) -> None:
        n = len(completions)
        self._seen.add("reward/mean", rewards_N.sum(), n)
        self._seen.add("reward/sq", (rewards_N.double() ** 2).sum(), n)
        for name, part_N in parts.items():
            if part_N.shape != rewards_N.shape:
                raise RuntimeError(
                    f"reward part {name!r} has shape {tuple(part_N.shape)}, expected {tuple(rewards_N.shape)}"
                )
            self._seen.add(f"reward/{name}_mean", part_N.sum(), n)
            self._seen.add(f"reward/{name}_sq", (part_N.double() ** 2).sum(), n)
        if not parts or "rule" in parts:
            correct_N = parts["rule"] if parts else rewards_N
            self._seen.add("reward/accuracy", (correct_N >= self.success_threshold - 1e-9).sum(), n)
        lengths = [c.generated_tokens for c in completions]
        self._seen.add("response/length", sum(lengths), n)
        self._seen.add_max("response/length_max", max(lengths, default=0))
        self._seen.add_min("response/length_min", min(lengths, default=0))
        self._seen.add("response/truncated", sum(c.truncated for c in completions), n)

    def need_another_round(self) -> bool:
        """True while dynamic sampling is on, rounds remain and any rank still lacks groups."""
        if not self.dynamic or self.rounds >= self.max_rounds:
            return False
        short = torch.tensor([int(len(self._kept) < self.want)], dtype=torch.int64)
        return bool(D.all_reduce_max(short).item())

    def finish(self) -> tuple[KeptGroups, dict[str, float]]:
        """The first K kept groups (K = the smallest count over ranks) and the step's sampling and reward metrics."""
        K = -int(D.all_reduce_max(torch.tensor([-min(len(self._kept), self.want)], dtype=torch.int64)).item())
        surplus = len(self._kept) - K
        kept = self._kept[:K]
        totals = D.all_reduce_sum(
            torch.tensor([self.generated, self.filtered, surplus, K, self.want], dtype=torch.float64)
        )
        m = self._seen.reduce()
        for sq in [k for k in m if k.startswith("reward/") and k.endswith("sq")]:
            base = sq[:-2]  # "reward/" or "reward/<part>_"
            m[base + "std"] = max(0.0, m.pop(sq) - m[base + "mean"] ** 2) ** 0.5
        m.update(
            {
                "sampling/rounds": float(self.rounds),
                "sampling/groups_generated": totals[0].item(),
                "sampling/groups_filtered": totals[1].item(),
                "sampling/groups_surplus": totals[2].item(),
                "sampling/groups_kept": totals[3].item(),
                "sampling/batch_fill": (totals[3] / totals[4]).item(),
            }
        )
        groups = KeptGroups(
            rows=[k[0] for k in kept],
            prompt_ids=[k[1] for k in kept],
            completions=[c for k in kept for c in k[2]],
            rewards_N=torch.cat([k[3] for k in kept]) if kept else torch.zeros(0),
            scores_N=torch.cat([k[4] for k in kept]) if kept else torch.zeros(0),
        )
        return groups, m
