"""Partial rollouts on 2 real gloo ranks, colocated: each rank's engine stops on its own groups, so the ranks can
hold different numbers of complete groups after a rollout; every step they train the same number, the fewest any
rank holds (capped at the rank's share of the batch), and carry the rest.

Oracle: each rank's complete groups counted from its pool at the step's take, compared across the ranks here."""

from __future__ import annotations

import os

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow
STEPS = 4


def _run_on_rank(rank: int, model_dir: str, out: str):
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.loop.partial import PartialRollouts
    from tests.checkpoint_helpers import ROOT, overrides

    complete, taken, real_take = [], [], PartialRollouts.take

    def take(self, n):
        complete.append(sum(g.complete for g in self.groups))
        out = real_take(self, n)
        taken.append(len(out))
        return out

    PartialRollouts.take = take
    extra = ("rollout.partial=true", "rollout.partial_stop=0.5", "rollout.partial_over=2", "trainer.max_staleness=2")
    cfg = load_config(
        os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        overrides(
            model_dir, out, *extra, "rollout.max_new_tokens=40", "data.batch_size=8", f"trainer.total_steps={STEPS}"
        ),
    )
    tr = Trainer(cfg)
    for _ in range(STEPS):
        tr.step()
    tr.close()
    return complete, taken


def test_the_ranks_train_as_many_groups_each_the_fewest_any_holds(tiny_model_dir, tmp_path):
    """Catches: the per-rank count reduced with max (a rank asked for groups it does not hold trains fewer than the
    others), or not reduced at all."""
    (c0, t0), (c1, t1) = run_ranks(_run_on_rank, world=2, args=(tiny_model_dir, str(tmp_path)), timeout=300)
    share = 8 // 2  # data.batch_size groups over 2 ranks
    assert t0 == t1 == [min(a, b, share) for a, b in zip(c0, c1)]
    assert any(a != b for a, b in zip(c0, c1)), "the ranks always held as many complete groups: nothing tested"
