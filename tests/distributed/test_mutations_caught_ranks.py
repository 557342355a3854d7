"""Tests added by a mutation-testing pass, on 2 real gloo ranks: each fails under a specific,
plausible bug that the rest of the suite let through (the docstrings name them)."""
from __future__ import annotations

import json

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow


def _same_prompt_step(rank: int, overrides: list[str]):
    from hybrid_rl import distributed as D
    from hybrid_rl import trainer as trainer_mod
    from hybrid_rl.config import load_config

    D.init("cpu", timeout_s=60)
    tr = trainer_mod.Trainer(load_config(None, overrides))
    seen = {}
    real_rollout = tr._rollout

    def rollout(engine, timer):
        batch, metrics = real_rollout(engine, timer)
        seen["completions"] = [c.token_ids for c in batch.completions]
        seen["prompts"] = [r["prompt"] for r in batch.rows]
        return batch, metrics

    tr._rollout = rollout
    m = tr.step()
    return {**seen, "optimizer_steps": tr.scheduler.last_epoch, "metrics": m}


@pytest.fixture(scope="module")
def same_prompt_step(tiny_model_dir, tmp_path_factory):
    """One 2-rank step on a dataset whose every row is the same prompt: 4 prompts x 2 samples
    per step over 2 ranks, global mini-batches of 4 sequences (2 per rank)."""
    out = tmp_path_factory.mktemp("same_prompt")
    data = out / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1 2 3 =", "answer": "234"}) + "\n" for _ in range(8)))
    overrides = [f"model.path={tiny_model_dir}", "data.task=jsonl", f"data.path={data}", "data.batch_size=4",
                 "rollout.n=2", "rollout.max_new_tokens=4", "algorithm.mini_batch_size=4", f"trainer.out_dir={out / 'run'}",
                 "trainer.progress_bar=false", "trainer.device=cpu", "trainer.dist_timeout_s=60", "optim.lr=1e-3"]
    return run_ranks(_same_prompt_step, world=2, args=(overrides,), timeout=120)


def test_ranks_sample_with_their_own_seeds(same_prompt_step):
    """Catches a rollout seed without the rank term: ranks given the same prompts would then
    generate the same completions, and data parallelism would train on duplicated samples."""
    r0, r1 = same_prompt_step
    assert r0["prompts"] == r1["prompts"], "the test needs both ranks to see identical prompts"
    assert r0["completions"] != r1["completions"], "ranks must sample independently"


def test_global_mini_batch_size_is_split_over_ranks(same_prompt_step):
    """Catches algorithm.mini_batch_size used as a per-rank size (not divided by the world size):
    4 global sequences per mini-batch are 2 per rank, so each rank's 4 sequences give 2
    optimizer steps, not 1."""
    r0, r1 = same_prompt_step
    assert r0["optimizer_steps"] == r1["optimizer_steps"] == 2


def _sharded(model) -> bool:
    """Every parameter is this rank's shard (FSDP2 swaps in plain full tensors while gathered)."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters())


def _residency_through_the_phases(rank: int, model_dir: str, own_weights: bool):
    import copy

    import torch

    from hybrid_rl import distributed as D
    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.logprobs import build_sequences
    from hybrid_rl.rollout.base import SamplingParams
    from hybrid_rl.rollout.native import NativeEngine
    from hybrid_rl.switch.phases import PhaseManager
    from hybrid_rl.update import score_logprobs

    dev = D.init("cpu", timeout_s=60)
    base = load_causal_lm(model_dir)
    # own_weights: an engine with its own (unsharded) copy that the switch syncs, as SGLang has.
    engine_model = copy.deepcopy(base) if own_weights else None
    model = shard_model(base, dev, False)
    engine = NativeEngine(engine_model if own_weights else model, pad_id=0, eos_id=1, own_weights=own_weights)
    pm = PhaseManager(model, torch.optim.AdamW(model.parameters(), lr=1e-3), engine, dev)
    seen = {"start": _sharded(model)}
    with pm.rollout() as engine:
        seen["rollout"] = _sharded(model)
        out = engine.generate([[4, 5, 6], [7, 8]], SamplingParams(max_new_tokens=3, seed=rank))
    seen["after_rollout"] = _sharded(model)
    with pm.score():
        ids, attn, _, P = build_sequences([[4, 5, 6], [7, 8]], [c.token_ids for c in out], pad_id=0)
        score_logprobs(model, ids, attn, P, 1.0, micro_batch_size=2)
        seen["scored"] = _sharded(model)
    seen["after_score"] = _sharded(model)
    with pm.train():
        pass
    return seen


@pytest.mark.parametrize("own_weights", [False, True], ids=["zero_copy_engine", "copy_engine"])
def test_the_policy_holds_only_its_shards_between_phases(tiny_model_dir, own_weights):
    """Catches a phase switch that forgets to free gathered weights: the native engine's release
    without release_full_weights (zero-copy: the whole policy stays gathered after ROLLOUT), or
    SCORE without reshard(policy) (copy engine: FSDP2 keeps the root module's parameters gathered
    after the scoring forward, since by default it expects a backward next)."""
    for seen in run_ranks(_residency_through_the_phases, world=2, args=(tiny_model_dir, own_weights), timeout=120):
        assert seen["start"], seen
        if own_weights:
            assert seen["rollout"] and not seen["scored"], f"the test must see the scoring forward gather: {seen}"
        else:
            assert not seen["rollout"], f"the zero-copy engine decodes with gathered weights: {seen}"
        assert seen["after_rollout"], "leaving ROLLOUT must free the gathered weights"
        assert seen["after_score"], "leaving SCORE must free what the scoring forward gathered"
