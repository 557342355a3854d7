"""The split placement wired into the Trainer (`trainer.placement=split`, hybrid_rl/split/), on 2 gloo ranks:
rank 0 the learner, rank 1 the rollout rank.

One launch runs every split config in order (each returning its result or its traceback, so only its own test
fails); the colocated reference runs in this process (one rank, no process group):
  k0        3 steps at max_staleness=0: the same completions as colocated on one process with the same seeds,
            and the same metrics within float tolerance (the rollout rank's loader slice and seeds are those of
            rank 0 of 1; the learner scores, shapes and updates with the colocated code);
  k1, k2    50 steps of a cheap config: the weights each trained batch was made with (reported by the rollout
            rank) are never more than k versions old, exactly k once the pipeline is full, nothing dropped;
  correct   k=1 with stale_samples=correct and tis_token: the correction gets the generating engine's
            log-probs (those the rollout rank sent), which differ from the learner's recomputed pi_old.
Every config also records weights on both sides, as digests of the whole fp32 model: the learner's after each
update v (and before the first, v = 0), the rollout engine's whenever it starts a batch, with the version it
says it holds. The version labels come from the protocol under test; the digests do not, so a sync that sends
the weights of another moment than its label (before the optimizer step) fails the weights test at every k,
where the label checks of k1 and k2 see nothing.
"""

from __future__ import annotations

import traceback

import pytest
import torch

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
]
CONFIGS = {
    "k0": (3, ["trainer.max_staleness=0"]),
    "k1": (50, ["trainer.max_staleness=1", "rollout.max_new_tokens=2"]),
    "k2": (50, ["trainer.max_staleness=2", "rollout.max_new_tokens=2"]),
    "correct": (
        4,
        ["trainer.max_staleness=1", "trainer.stale_samples=correct", "algorithm.rollout_correction=tis_token"],
    ),
}


def _digest(model: torch.nn.Module) -> str:
    """The whole model's weights (full tensors of FSDP2 shards), fp32 bytes in name order: equal digests, equal
    weights bit for bit. A collective on sharded learner ranks: every learner calls it at the same point."""
    import hashlib

    from hybrid_rl.models.weights import full_tensor

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(full_tensor(p.detach()).to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _fit(overrides: list[str], steps: int) -> dict:
    """fit(steps) with spies on what the update trains and what the correction gets (this rank only), and the
    weights: the learner's after each update (index v = after update v), or the rollout engine's at the start of
    each batch with the version it holds."""
    from hybrid_rl import trainer as trainer_mod
    from hybrid_rl.config.load import load_config
    from hybrid_rl.loop import advantage_stage as adv_mod

    seen = {"ids": [], "corr": [], "weights": []}
    real_update, real_corr = trainer_mod.policy_update, adv_mod.rollout_correction

    def update(**kwargs):
        seen["ids"].append(kwargs["batch"].ids_NL.clone())
        out = real_update(**kwargs)
        seen["weights"].append(_digest(kwargs["policy"]))
        return out

    def correction(old_logp_NT, engine_logp_NT, *args, **kwargs):
        seen["corr"].append((old_logp_NT.clone(), engine_logp_NT.clone()))
        return real_corr(old_logp_NT, engine_logp_NT, *args, **kwargs)

    trainer_mod.policy_update, adv_mod.rollout_correction = update, correction
    try:
        tr = trainer_mod.Trainer(load_config(None, overrides))
        if getattr(tr, "is_rollout", False):
            side, real_run = tr.rollout_side, tr.rollout_side.stage.run

            def run(engine, loader, step, *args, **kwargs):
                seen["weights"].append((step, side.version, _digest(engine.model)))
                return real_run(engine, loader, step, *args, **kwargs)

            side.stage.run = run
        else:
            seen["weights"].append(_digest(tr.policy))  # version 0: before any update
        history = tr.fit(steps)
        tr.close()
    finally:
        trainer_mod.policy_update, adv_mod.rollout_correction = real_update, real_corr
    keep = [{k: v for k, v in m.items() if isinstance(v, (int, float))} for m in history]
    return {"history": keep, **seen}


def _split_rank(rank: int, model_dir: str, out_root: str) -> dict:
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    results = {}
    for name, (steps, extra) in CONFIGS.items():
        overrides = [
            f"model.path={model_dir}",
            f"trainer.out_dir={out_root}/{name}",
            *BASE,
            "trainer.placement=split",
            "trainer.rollout_ranks=1",
            *extra,
        ]
        try:
            results[name] = _fit(overrides, steps)
        except Exception:  # noqa: BLE001 - this config's test reports it
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def split_runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("split")
    learner, rollout = run_ranks(_split_rank, world=2, args=(tiny_model_dir, str(out)), timeout=600)
    for name, r in learner.items():
        if isinstance(r, dict):
            r["rollout"] = rollout[name]  # the rollout rank's result (or its traceback)
    return learner


def _result(runs: dict, name: str) -> dict:
    r = runs[name]
    if isinstance(r, str):
        pytest.fail(f"split config {name} failed on the learner:\n{r}")
    return r


def test_k0_split_trains_on_the_samples_colocated_would(split_runs, tiny_model_dir, tmp_path):
    """Catches: the rollout rank drawing another loader slice or other sampling seeds, the learner scoring or
    updating differently from the colocated step, groups reordered or mis-tagged in transit. Both placements
    build their batches with the same code, so this is blind to a mask both get wrong (tests/unit/test_batch.py
    pins it); the weights each version carries are the weights test's below, at every k."""
    steps, extra = CONFIGS["k0"]
    colocated = _fit([f"model.path={tiny_model_dir}", f"trainer.out_dir={tmp_path}", *BASE, *extra], steps)
    split = _result(split_runs, "k0")
    assert len(split["ids"]) == len(colocated["ids"]) == steps
    for s, (a, b) in enumerate(zip(split["ids"], colocated["ids"])):
        assert torch.equal(a, b), f"step {s + 1}: split trained other sequences than colocated"
    for s, (a, b) in enumerate(zip(split["history"], colocated["history"])):
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_ref", "actor/grad_norm", "response/length"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), f"step {s + 1}: {key}"
        assert a["split/staleness_max"] == 0.0 and a["split/weights_version"] == s


@pytest.mark.parametrize("name, k", [("k1", 1), ("k2", 2)])
def test_no_trained_sample_is_more_than_k_versions_old(split_runs, name, k):
    """Catches: an off-by-one in admission (a batch made with weights k + 1 old: its groups are dropped, or it
    hangs), weights synced too early (lag below k once the pipeline is full: no overlap), a skipped sync."""
    h = _result(split_runs, name)["history"]
    assert len(h) == 50
    lags = [m["step"] - 1 - m["split/weights_version"] for m in h]  # batch s-1 made by version v: lag s-1-v
    assert max(lags) <= k, lags
    assert lags[k:] == [k] * (50 - k), lags
    assert all(m["split/staleness_max"] == lag for m, lag in zip(h, lags))
    assert sum(m["split/dropped"] for m in h) == 0


def test_correct_uses_the_generating_engines_logprobs(split_runs):
    """Catches: the correction given the learner's recomputed log-probs as the behaviour policy (a ratio of 1:
    no correction) instead of those of the weights that generated the tokens."""
    r = _result(split_runs, "correct")
    assert len(r["corr"]) == 4
    mask_any = False
    for s, (old, engine) in enumerate(r["corr"][1:], start=2):  # from step 2 on, lag 1: the weights moved
        assert not torch.allclose(old, engine), f"step {s}: behaviour log-probs equal the learner's pi_old"
        mask_any = True
    assert mask_any
    assert all("rollout/tis_weight_mean" in m or any(k.startswith("rollout/") for k in m) for m in r["history"])


@pytest.mark.parametrize("name", ["k0", "k1", "k2"])
def test_each_batch_is_generated_with_the_learners_weights_of_its_version(split_runs, name):
    """Catches: weights sent before the optimizer step (the rollout side then generates version v's batches with
    the weights of v - 1 under the label v), a sync that sends a stale or partial copy, a rollout rank that
    generates before applying a version it received. The label checks above read the protocol's own version
    numbers; here the weights themselves are compared, learner's against rollout engine's."""
    steps = CONFIGS[name][0]
    r = _result(split_runs, name)
    rollout = r["rollout"]
    if isinstance(rollout, str):
        pytest.fail(f"split config {name} failed on the rollout rank:\n{rollout}")
    learner = r["weights"]  # learner[v]: the learner's weights after update v (v = 0: as loaded)
    assert len(learner) == steps + 1
    assert all(a != b for a, b in zip(learner, learner[1:])), "every update must move the weights"
    used = rollout["weights"]
    assert [b for b, _, _ in used] == list(range(steps)), "one record per batch, in order"
    k = {"k0": 0, "k1": 1, "k2": 2}[name]
    assert [v for _, v, _ in used] == [max(0, b - k) for b in range(steps)]
    for b, v, digest in used:
        assert digest == learner[v], (
            f"batch {b}: the rollout engine's weights of version {v} are not the learner's after update {v}"
            + (" (they are those after update %d)" % learner.index(digest) if digest in learner else "")
        )
