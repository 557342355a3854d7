"""LoRA through the real Trainer (issue 29): 2 gloo ranks train the adapters like one process.

Ranks sample with their own seeds, so one process cannot draw the same completions. Instead the 2-rank run
records each rank's rollout of every step, and one process replays them, a step's two rank batches as one
(prompt groups interleaved, rank 0's first), through its own Trainer: the score, reference (adapters off), KL,
loss, FSDP gradient all-reduce, clipping and AdamW step are then the library's, and only the sampling is
replayed. One mini-batch per step (algorithm.mini_batch_size=0): a shuffle over 2 x 16 rows is not the shuffle
over 32. Compared every step: the global metrics the ranks report, then the adapters at the end.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoint_helpers import ROOT
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow

STEPS = 3
# What the step computes from the batch; the rollout metrics (reward/*, response/*) describe the replaying
# process's own discarded sampling, so they are not compared.
COMPARED = (
    "actor/loss",
    "actor/grad_norm",
    "actor/kl_ref",
    "actor/entropy",
    "actor/approx_kl",
    "rollout/logp_mismatch",
)


def _overrides(model_dir: str, out: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"trainer.out_dir={out}",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "data.batch_size=8",
        "rollout.n=4",
        "rollout.max_new_tokens=4",
        "algorithm.mini_batch_size=0",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_placement=loss",
        "algorithm.kl_estimator=k3",
        "optim.lr=2e-2",
        "optim.lr_schedule=constant",
        "optim.min_lr_ratio=0.0",
        "trainer.micro_batch_size=8",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "trainer.log_every=0",
        "trainer.val_every=0",
    ]


def _record(b) -> dict:
    return {
        "rows": b.rows,
        "prompt_ids": b.prompt_ids,
        "completions": b.completions,
        "G": b.group_size,
        "rewards_N": b.rewards_N,
        "scores_N": b.scores_N,
    }


def _adapters(trainer) -> dict:
    from hybrid_rl.models.lora import adapter_named_tensors

    return {n: t.clone() for n, t in adapter_named_tensors(trainer.policy)}


def _rank_run(rank: int, model_dir: str, out: str) -> dict:
    from hybrid_rl import Trainer
    from hybrid_rl.config.load import load_config
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    tr = Trainer(load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), _overrides(model_dir, out)))
    real, seen = tr.rollout_stage.run, []

    def rollout(*args, **kwargs):
        batch, metrics = real(*args, **kwargs)
        seen.append(_record(batch))
        return batch, metrics

    tr.rollout_stage.run = rollout
    metrics = [tr.step() for _ in range(STEPS)]
    return {"rollouts": seen, "metrics": metrics, "adapters": _adapters(tr)}


def _interleaved(r0: dict, r1: dict):
    """One batch of both ranks' groups: group k of rank 0, group k of rank 1, ... (the order does not change one
    whole-batch update; interleaving keeps every group's G rows together, as GRPO's advantage needs)."""
    from hybrid_rl.batch import RolloutBatch

    G, B = r0["G"], len(r0["rows"])
    rows, prompts, comps, rewards, scores = [], [], [], [], []
    for k in range(B):
        for r in (r0, r1):
            rows.append(r["rows"][k])
            prompts.append(r["prompt_ids"][k])
            comps.extend(r["completions"][k * G : (k + 1) * G])
            rewards.append(r["rewards_N"][k * G : (k + 1) * G])
            scores.append(r["scores_N"][k * G : (k + 1) * G])
    return RolloutBatch.build(
        rows, prompts, comps, G, torch.cat(rewards), torch.cat(scores), pad_id=0, device=torch.device("cpu")
    )


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    from hybrid_rl import Trainer
    from hybrid_rl.config.load import load_config

    out = tmp_path_factory.mktemp("lora_ranks")
    r0, r1 = run_ranks(_rank_run, world=2, args=(tiny_model_dir, str(out / "two")), timeout=300)
    one = Trainer(
        load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), _overrides(tiny_model_dir, str(out / "one")))
    )
    real, step = one.rollout_stage.run, {"k": 0}

    def replay(*args, **kwargs):
        _, metrics = real(*args, **kwargs)  # this process's own sampling, discarded
        k = step["k"]
        step["k"] += 1
        return _interleaved(r0["rollouts"][k], r1["rollouts"][k]), metrics

    one.rollout_stage.run = replay
    metrics = [one.step() for _ in range(STEPS)]
    return {"two": (r0, r1), "one": {"metrics": metrics, "adapters": _adapters(one)}}


def test_two_ranks_report_the_metrics_of_one_process_on_the_same_samples(runs):
    """Catches: a LoRA gradient not averaged over the ranks (grad_norm and then the loss of the next steps
    differ), a per-rank token-mean normaliser, the reference scored with the adapters on (kl_ref 0 everywhere
    but on one side), or ranks whose adapters drift apart."""
    (r0, r1), one = runs["two"], runs["one"]
    assert len(r0["rollouts"][0]["completions"]) == 16, "each rank samples its 4 prompts x 4"
    for step in range(STEPS):
        m0, m1, m = r0["metrics"][step], r1["metrics"][step], one["metrics"][step]
        for key in COMPARED:
            assert m0[key] == pytest.approx(m1[key], rel=1e-9, abs=1e-12), f"step {step + 1}: ranks disagree on {key}"
            assert m0[key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), f"step {step + 1}: {key} 2 ranks vs 1"
    assert one["metrics"][-1]["actor/kl_ref"] > 1e-6, "the adapters must have moved the policy off the reference"
    assert one["metrics"][0]["actor/grad_norm"] > 1e-4


def test_two_ranks_end_with_the_adapters_of_one_process(runs):
    """Catches: adapter gradients left unsynchronised (each rank steps on its own half), or ranks that start
    from different adapter inits."""
    (r0, r1), one = runs["two"], runs["one"]
    assert set(one["adapters"]) == set(r0["adapters"]) == set(r1["adapters"]) and one["adapters"]
    # Adam divides by sqrt(v): a gradient entry near 0 turns float noise into an update difference of ~1e-5,
    # while a wrong step moves an entry by about the learning rate (2e-2).
    for name, want in one["adapters"].items():
        assert torch.equal(r0["adapters"][name], r1["adapters"][name]), f"ranks hold different {name}"
        torch.testing.assert_close(r0["adapters"][name], want, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
    moved = max(t.abs().max().item() for n, t in one["adapters"].items() if "lora_B" in n)
    assert moved > 1e-3, "lora_B starts at zero: it must have trained"
