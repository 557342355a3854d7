"""Validation in the split placement (trainer.val_every, val_before_train; hybrid_rl/split/validation.py), on 2 gloo
ranks: rank 0 learns, rank 1 generates and validates. One launch runs both configs in order (each returns its
result or its traceback):
  k0  max_staleness=0, val_every=1 and val_before_train, 3 steps, greedy and 2 sampled completions per prompt;
      against colocated on one process with the same seeds (the reference runs in this process);
  k1  max_staleness=1, val_every=2, 5 steps: steps 2 (a version the batches bring anyway), 4 and 5 (versions
      no batch is made with, sent for the validation alone);
  stop  max_staleness=1, 3 steps validating the last only, SIGINT on the learner during step 2: the rollout rank
      has made its batches and waits for version 3, sent for the last step's validation alone.
Every config records weights on both sides as digests of the whole fp32 model: the learner's after each update
v (and v = 0 before the first), the rollout rank's whenever its Validator runs, with the step it validates. The
version tag (val/weights_version) is the protocol's own number; the digests are the weights themselves.
"""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow

BASE = [
    "data.batch_size=4",
    "data.val_split=0.1",
    "data.val_size=8",
    "data.val_batch_size=4",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "trainer.progress_bar=false",
    "trainer.device=cpu",
    "trainer.log_every=0",
    "trainer.val_n=2",
    "trainer.val_sample_rows=2",
    "optim.lr=1e-2",
    "algorithm.kl_coef=0.01",
]
CONFIGS = {
    "k0": (3, ["trainer.max_staleness=0", "trainer.val_every=1", "trainer.val_before_train=true"]),
    "k1": (5, ["trainer.max_staleness=1", "trainer.val_every=2"]),
    "stop": (3, ["trainer.max_staleness=1", "trainer.val_every=5", "trainer.dist_timeout_s=60"]),
}
# What a validation measures (val/time_s, val/switch_s are clocks; val/weights_version and val/wait_s are split's).
MEASURED = ("val/pass@1", "val/reward_mean", "val/response_length", "val/truncated", "val/mean@2", "val/pass@2")


def _digest(model: torch.nn.Module) -> str:
    """The whole model's weights (full tensors of FSDP2 shards), fp32 bytes in name order."""
    import hashlib

    from hybrid_rl.models.weights import full_tensor

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(full_tensor(p.detach()).to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _fit(overrides: list[str], steps: int, signal_at: int = 0) -> dict:
    """fit(steps) with the weights spied on: the learner's after each update, the validating engine's; with
    signal_at, a SIGINT on the learner in the update that makes that version."""
    import signal

    from hybrid_rl import trainer as trainer_mod
    from hybrid_rl.config.load import load_config
    from hybrid_rl.loop import validation as val_mod
    from hybrid_rl.runtime.stop import TrainingInterrupted

    seen = {"weights": [], "validated": []}
    real_update, real_measure = trainer_mod.policy_update, val_mod.Validator.measure

    def update(**kwargs):
        out = real_update(**kwargs)
        seen["weights"].append(_digest(kwargs["policy"]))
        if len(seen["weights"]) - 1 == signal_at:
            signal.raise_signal(signal.SIGINT)
        return out

    def measure(self, step):
        resident = getattr(self.phases, "engine", None)  # a split rollout rank's (colocated: the phase switch)
        if resident is not None:
            seen["validated"].append((step, _digest(resident.model)))
        return real_measure(self, step)

    trainer_mod.policy_update, val_mod.Validator.measure = update, measure
    try:
        tr = trainer_mod.Trainer(load_config(None, overrides))
        if not tr.is_rollout:
            seen["weights"].append(_digest(tr.policy))  # version 0: before any update
        try:
            history = tr.fit(steps)
        except TrainingInterrupted as stop:
            return {"interrupted": stop.step, "rollout": tr.is_rollout}
        tr.close()
    finally:
        trainer_mod.policy_update, val_mod.Validator.measure = real_update, real_measure
    out = tr.cfg.trainer.out_dir
    files = {}
    if not tr.is_rollout:
        for name in ("metrics.jsonl", "val_samples.jsonl"):
            with open(os.path.join(out, name)) as f:
                files[name] = [json.loads(line) for line in f]
    keep = [{k: v for k, v in m.items() if isinstance(v, (int, float))} for m in history]
    return {"history": keep, "rollout": tr.is_rollout, "files": files, **seen}


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
            results[name] = _fit(overrides, steps, signal_at=2 if name == "stop" else 0)
        except Exception:  # noqa: BLE001 - this config's test reports it
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def split_runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("split_val")
    return run_ranks(_split_rank, world=2, args=(tiny_model_dir, str(out)), timeout=600)


def _result(runs, name: str, rank: int) -> dict:
    r = runs[rank][name]
    if isinstance(r, str):
        pytest.fail(f"split config {name} failed on rank {rank}:\n{r}")
    return r


def _val_steps(result: dict) -> list[int]:
    """The steps whose metrics.jsonl line holds val/* (step 0: the line before training)."""
    return [line["step"] for line in result["files"]["metrics.jsonl"] if "val/pass@1" in line]


def test_k0_split_validates_at_colocated_steps_with_colocated_results(split_runs, tiny_model_dir, tmp_path):
    """Catches: validation at other steps than colocated's (before training, every step, the last), results not
    logged by learner rank 0 at their step, or measured with other weights than colocated validates (greedy and
    sampled: the rollout rank's validation slice and seeds are those of rank 0 of 1). Both placements validate
    with the same Validator, so what it gets wrong alike is tests/unit/loop/test_validation.py's."""
    steps, extra = CONFIGS["k0"]
    colocated = _fit([f"model.path={tiny_model_dir}", f"trainer.out_dir={tmp_path}", *BASE, *extra], steps)
    split = _result(split_runs, "k0", 0)
    assert _val_steps(split) == _val_steps(colocated) == [0, 1, 2, 3]
    lines = {line["step"]: line for line in split["files"]["metrics.jsonl"]}
    reference = {line["step"]: line for line in colocated["files"]["metrics.jsonl"]}
    for step in (0, 1, 2, 3):
        assert lines[step]["val/weights_version"] == step, f"step {step}: validated another version"
        for key in MEASURED:
            assert lines[step][key] == reference[step][key], f"step {step}: {key}"
    for s, m in enumerate(split["history"], start=1):
        assert m["val/weights_version"] == s and all(k in m for k in MEASURED)
    # The samples: the learner writes the rollout rank's, at the steps colocated writes its own.
    got = [(r["step"], r["prompt"], r["completion"]) for r in split["files"]["val_samples.jsonl"]]
    want = [(r["step"], r["prompt"], r["completion"]) for r in colocated["files"]["val_samples.jsonl"]]
    assert got == want and len(got) == 2 * 4


@pytest.mark.parametrize("name", ["k0", "k1"])
def test_each_validation_runs_with_the_learners_weights_of_its_step(split_runs, name):
    """Catches: validating before the version arrives (the previous version's weights under the new step),
    a version tag that is not the weights' (the digests are compared, not the labels), a validation-only
    sync not sent or sent from the weights of another step, a validation that moves the batches' schedule."""
    steps = CONFIGS[name][0]
    learner, rollout = _result(split_runs, name, 0), _result(split_runs, name, 1)
    k = 0 if name == "k0" else 1
    want = [0, 1, 2, 3] if name == "k0" else [2, 4, 5]
    assert [s for s, _ in rollout["validated"]] == want
    for step, digest in rollout["validated"]:
        assert digest == learner["weights"][step], f"step {step}: validated weights are not version {step}'s"
    assert _val_steps(learner) == want
    h = learner["history"]
    assert len(h) == steps
    for m in h:
        assert m["split/weights_version"] == max(0, m["step"] - 1 - k)  # batches keep their versions
        if m["step"] in want:
            assert m["val/weights_version"] == m["step"]
        else:
            assert "val/pass@1" not in m


def test_a_signal_ends_a_rollout_rank_waiting_for_a_validation_only_version(split_runs):
    """Catches: no STOP sent where the rollout rank waits for a version sent for validation alone (it made
    every batch and waits for version 3; it would wait out its timeout and raise here)."""
    learner, rollout = _result(split_runs, "stop", 0), _result(split_runs, "stop", 1)
    assert learner["interrupted"] == 2
    assert "interrupted" not in rollout and rollout["validated"] == [], "the rollout rank must end on STOP"
