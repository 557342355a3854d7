"""Split placement checks (hybrid_rl/split/placement.py): every impossible combination is refused naming
the key to change, and the layout puts the rollout ranks last."""

from __future__ import annotations

import pytest

from hybrid_rl.split.placement import Layout, check_placement


def test_layout_puts_rollout_ranks_last():
    lay = check_placement(8, 2, 1, "drop", batch_size=48, group_size=8)
    assert lay.learners == [0, 1, 2, 3, 4, 5] and lay.rollouts == [6, 7]
    assert lay.role(5) == "learner rank 5" and lay.role(6) == "rollout rank 6"
    assert Layout(2, 1).is_rollout(1) and not Layout(2, 1).is_rollout(0)


@pytest.mark.parametrize(
    "kwargs, key, text",
    [
        (dict(world_size=2, rollout_ranks=2), "trainer.rollout_ranks", "leave no learner"),
        (dict(world_size=2, rollout_ranks=3), "trainer.rollout_ranks", "use at most 1"),
        (dict(world_size=2, rollout_ranks=0), "trainer.rollout_ranks", "at least 1 rollout rank"),
        (dict(world_size=8, rollout_ranks=3, tp_size=2), "rollout.tp_size", "does not divide trainer.rollout_ranks=3"),
        (dict(max_staleness=-1), "trainer.max_staleness", ">= 0"),
        (dict(stale_samples="keep"), "trainer.stale_samples", "expected one of"),
        (dict(stale_samples="correct"), "trainer.stale_samples", "algorithm.rollout_correction is 'none'"),
        (dict(world_size=8, rollout_ranks=3, batch_size=16), "data.batch_size", "3 rollout engines"),
        (dict(engine="vllm"), "rollout.engine", "learner ranks never join"),
        (dict(world_size=8, rollout_ranks=1, batch_size=5, group_size=1), "data.batch_size", "7 learner ranks"),
        (
            dict(world_size=4, rollout_ranks=1, batch_size=6, group_size=4, mini_batch_size=8),
            "algorithm.mini_batch_size",
            "3 learner ranks",
        ),
    ],
)
def test_impossible_placements_name_the_key(kwargs, key, text):
    args = dict(world_size=4, rollout_ranks=2, max_staleness=1, stale_samples="drop")
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"config key '{key}': .*{text}"):
        check_placement(
            args.pop("world_size"),
            args.pop("rollout_ranks"),
            args.pop("max_staleness"),
            args.pop("stale_samples"),
            **args,
        )


def test_correct_with_a_correction_and_tp_engines_pass():
    lay = check_placement(
        8, 4, 2, "correct", tp_size=2, batch_size=32, group_size=8, mini_batch_size=64, rollout_correction="tis_token"
    )
    assert lay.rollouts == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "extra",
    [[], ["reward.normalize_model=true"], ["model.lora.rank=4"], ["trainer.val_every=1", "data.val_split=0.1"]],
)
def test_a_reward_model_its_normaliser_lora_and_validation_are_let_through(tmp_path, extra):
    """Catches: split refusing again what it now runs (issue 37: the normaliser in the checkpoint, validation on
    the rollout ranks, adapter-only syncs); split/roles.py setup, before any group or model is built, so no
    process group is needed here: getting past it reaches the groups' own check."""
    import torch

    from hybrid_rl.config.load import load_config
    from hybrid_rl.split import roles

    base = ["trainer.placement=split", "trainer.rollout_ranks=1", f"reward.model_path={tmp_path}"]
    with pytest.raises(ValueError, match=r"config key 'trainer.placement': split needs several processes"):
        roles.setup(load_config(None, [*base, *extra]), torch.device("cpu"))
