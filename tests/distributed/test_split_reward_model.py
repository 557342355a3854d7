"""A reward model in the split placement (`trainer.placement=split`, `reward.model_path`), on real gloo ranks.

The reward model lives on the rollout ranks (split/roles.py load_rollout_models says why): unsharded on the one
rollout rank of a 1 + 1 run, FSDP2-sharded over the rollout ranks when there are several; the learners never
load it. Two launches:
  1 + 1 (world 2)  k=0, 3 steps: the same rewards (rule, model and their sum) and training metrics as colocated on
                   one process with the same seeds, which scores with the same (unsharded) reward model;
  1 + 2 (world 3)  k=1, 2 steps: each rollout rank holds half of every sharded reward-model parameter, over a
                   mesh of the two rollout ranks, and the run trains.
Every rank reports what it built: how often it loaded the reward model, and how the module is placed.
"""

from __future__ import annotations

import traceback

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow

BASE = [
    "data.batch_size=4",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "trainer.progress_bar=false",
    "trainer.device=cpu",
    "trainer.log_every=0",
    "optim.lr=1e-2",
    "algorithm.kl_coef=0.01",
    "reward.weights.rule=1",
    "reward.weights.model=0.5",
    "reward.max_tokens_per_micro_batch=16",
]
REWARD_KEYS = ("reward/mean", "reward/rule_mean", "reward/model_mean", "reward/model_std")
TRAIN_KEYS = ("actor/loss", "actor/kl_ref", "actor/grad_norm", "response/length")


def _placement(module) -> dict:
    """How a reward model module is held on this rank: sharded (DTensor parameters), over which ranks, and the
    fraction of its elements this rank holds."""
    if module is None:
        return {"module": False}
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(module, FSDPModule):
        module.reshard()  # FSDP2 leaves the root's parameters gathered after a forward
    params = list(module.parameters())
    dt = [p for p in params if isinstance(p, DTensor)]
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    total = sum(p.numel() for p in params)
    ranks = sorted(dt[0].device_mesh.mesh.flatten().tolist()) if dt else []
    return {
        "module": True,
        "sharded": len(dt) == len(params) > 0,
        "mesh_ranks": ranks,
        "local_fraction": local / total,
        "frozen": not any(p.requires_grad for p in params),
    }


def _fit(overrides: list[str], steps: int) -> dict:
    """fit(steps), counting this rank's reward-model loads; what the run trained and where its reward model is."""
    from hybrid_rl.config.load import load_config
    from hybrid_rl.loop import reward_setup as setup_mod
    from hybrid_rl.trainer import Trainer

    loads, real_load = [], setup_mod.load_reward_model

    def load(*args, **kwargs):
        loads.append(1)
        return real_load(*args, **kwargs)

    setup_mod.load_reward_model = load
    try:
        tr = Trainer(load_config(None, overrides))
        history = tr.fit(steps)
        tr.close()
    finally:
        setup_mod.load_reward_model = real_load
    keep = [{k: v for k, v in m.items() if isinstance(v, (int, float))} for m in history]
    return {"history": keep, "loads": len(loads), "rollout": tr.is_rollout, **_placement(tr.rewards.module)}


def _rank(rank: int, model_dir: str, rm_dir: str, out: str, rollout_ranks: int, steps: int, k: int) -> dict:
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    overrides = [
        f"model.path={model_dir}",
        f"reward.model_path={rm_dir}",
        f"trainer.out_dir={out}",
        *BASE,
        "trainer.placement=split",
        f"trainer.rollout_ranks={rollout_ranks}",
        f"trainer.max_staleness={k}",
    ]
    try:
        return _fit(overrides, steps)
    except Exception:  # noqa: BLE001 - reported by the test that reads this rank
        return {"error": traceback.format_exc()}


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from hybrid_rl.rewards.tiny_model import random_reward_model_dir

    return random_reward_model_dir(str(tmp_path_factory.mktemp("split_rm") / "rm"))


@pytest.fixture(scope="module")
def one_plus_one(tiny_model_dir, rm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("split_rm_2")
    return run_ranks(_rank, world=2, args=(tiny_model_dir, rm_dir, str(out), 1, 3, 0), timeout=600)


@pytest.fixture(scope="module")
def one_plus_two(tiny_model_dir, rm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("split_rm_3")
    return run_ranks(_rank, world=3, args=(tiny_model_dir, rm_dir, str(out), 2, 2, 1), timeout=600)


def _ok(r: dict) -> dict:
    if "error" in r:
        pytest.fail(r["error"])
    return r


def test_k0_split_with_a_reward_model_scores_and_trains_as_colocated(one_plus_one, tiny_model_dir, rm_dir, tmp_path):
    """Catches: the rollout rank scoring without the reward model (no model part, another reward/mean), scoring
    it with other inputs or another copy than colocated, the model part lost on the way to the learner."""
    learner, rollout = (_ok(r) for r in one_plus_one)
    colocated = _fit(
        [
            f"model.path={tiny_model_dir}",
            f"reward.model_path={rm_dir}",
            f"trainer.out_dir={tmp_path}",
            *BASE,
            "trainer.max_staleness=0",
        ],
        3,
    )
    assert len(learner["history"]) == len(colocated["history"]) == 3
    for s, (a, b) in enumerate(zip(learner["history"], colocated["history"])):
        for key in REWARD_KEYS + TRAIN_KEYS:
            assert key in a and key in b, f"step {s + 1}: {key} missing (split: {key in a})"
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), f"step {s + 1}: {key}"
    assert learner["history"][0]["reward/model_std"] > 0, "the reward model's scores vary: the test can see them"
    # One rollout rank: one whole copy there (no peer to shard with), as the one colocated process holds it.
    assert rollout["rollout"] and rollout["loads"] == 1
    assert rollout["module"] and not rollout["sharded"] and rollout["local_fraction"] == 1.0 and rollout["frozen"]


def test_two_rollout_ranks_shard_the_reward_model_between_them_and_train(one_plus_two):
    """Catches: the reward model sharded over the whole world (the learner would have to join every forward),
    held whole on each rollout rank, or not at all; the run not training its 2 steps."""
    learner, *rollouts = (_ok(r) for r in one_plus_two)
    assert len(learner["history"]) == 2
    for m in learner["history"]:
        assert m["reward/model_std"] > 0 and "actor/grad_norm" in m
        assert m["reward/mean"] == pytest.approx(m["reward/rule_mean"] + 0.5 * m["reward/model_mean"], abs=1e-5)
    for r in rollouts:
        assert r["rollout"] and r["loads"] == 1 and r["module"] and r["frozen"]
        assert r["sharded"] and r["mesh_ranks"] == [1, 2]
        assert r["local_fraction"] == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("world", [2, 3])
def test_the_learner_ranks_never_load_the_reward_model(one_plus_one, one_plus_two, world):
    """Catches: the learners loading (and probing) the reward model as the colocated path does."""
    learner = _ok((one_plus_one if world == 2 else one_plus_two)[0])
    assert not learner["rollout"] and learner["loads"] == 0 and not learner["module"]
