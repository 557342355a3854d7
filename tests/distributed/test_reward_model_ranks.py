"""A reward model on 2 real gloo ranks: FSDP2-sharded scoring, the REWARD stage with and without
offload (bit-identical scores), the planner's bill for the `reward_model` role equal to the ledger to
the byte, and a `Trainer` step with a reward model on both ranks.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow

N_LOCAL, PROMPT, NEW = 3, 5, 4  # rollout sequences per rank, prompt tokens, generated tokens
BUDGET = 24  # reward-model tokens per micro-batch: the two ranks need different numbers of micro-batches


def _texts(rank: int) -> tuple[list[str], list[str]]:
    """Rank 0 short completions, rank 1 long ones: another number of micro-batches on each rank."""
    prompts = ["1 2 3 =", "4 5 6 =", "7 8 9 =", "0 1 2 ="]
    if rank == 0:
        return prompts, ["2 3 4", "5", "", "1 2"]
    return prompts, ["5 6 7 8 9 0 1 2", "5 6 7 8 9 0 1 2 3 4", "8 9 0 1 2 3", "1 2 3 4 5 6 7"]


def _cycle(pm, engine_prompts, scorer, prompts, texts, rank: int, scribble: bool):
    """One TRAIN -> ROLLOUT (+ REWARD) -> SCORE -> TRAIN round; returns the reward model's scores."""
    from hybrid_rl.types import SamplingParams

    if scribble:  # what the device would hold while the model is on the host
        with torch.no_grad():
            for t in [*pm.reward_model.parameters(), *pm.reward_model.buffers()]:
                (t.to_local() if hasattr(t, "to_local") else t).fill_(float("nan"))
    with pm.rollout() as engine:
        engine.generate(engine_prompts, SamplingParams(max_new_tokens=NEW, seed=rank))
        with pm.reward() as rm:
            scores = scorer(rm, prompts, texts)
    with pm.score():
        pass
    with pm.train() as opt:
        pm.policy(input_ids=torch.tensor([[4, 5, 6]])).logits.sum().backward()
        opt.step()
    return scores


def _rank_fn(rank: int, model_dir: str, rm_dir: str, overrides: list[str]) -> dict:
    import copy

    from transformers import AutoModelForSequenceClassification

    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.rewards.model import RewardModelScorer, encode_texts, inspect_reward_model, load_reward_model
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.switch.phases import PhaseManager

    dev = D.init("cpu", timeout_s=60)
    torch.manual_seed(0)
    base = load_causal_lm(model_dir)
    ref = shard_model(copy.deepcopy(base).requires_grad_(False), dev, False)
    model = shard_model(base, dev, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[4, 5, 6]])).logits.sum().backward()
    opt.step()
    spec, tok = inspect_reward_model(rm_dir)
    scorer = RewardModelScorer(spec, tok, dev, BUDGET)
    prompts, texts = _texts(rank)
    engine_prompts = [[4 + i] * PROMPT for i in range(N_LOCAL)]
    out = {}
    for offload in (False, True):
        rm = load_reward_model(spec, dev, bf16=False)
        # eos_id -1 never matches: every row decodes all NEW tokens, so the KV cache is full-length.
        pm = PhaseManager(
            model,
            opt,
            NativeEngine(model, pad_id=0, eos_id=-1),
            dev,
            ref=ref,
            offload_ref=offload,
            reward_model=rm,
            offload_reward_model=offload,
            always_copy=offload,
        )
        out[offload] = {
            "scores": [_cycle(pm, engine_prompts, scorer, prompts, texts, rank, scribble=offload) for _ in range(2)],
            "ledger": {s.label: s.roles for s in pm.ledger.rollout_snapshots(pm.rollouts)},
            "micro_batches": scorer.last_micro_batches,
            "moved": pm.pop_stats().bytes.get("onload_reward_model", 0),
            "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in rm.parameters()),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in rm.buffers()),
            "sharded": all(hasattr(p, "to_local") for p in rm.parameters()),
            "frozen": all(not p.requires_grad for p in rm.parameters()) and not rm.training,
        }
    plain = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32, pad_token_id=None).eval()
    with torch.no_grad():
        out["reference"] = torch.stack(
            [plain(input_ids=torch.tensor([x])).logits[0, 0] for x in encode_texts(tok, prompts, texts)]
        )

    # The trainer on both ranks: rule + model reward, the model offloaded outside its stage.
    from hybrid_rl.config.load import load_config
    from hybrid_rl.trainer import Trainer

    tr = Trainer(load_config(None, overrides))
    m = tr.step()
    out["trainer"] = {
        "metrics": m,
        "ledger": {s.label: s.roles for s in tr.phases.ledger.rollout_snapshots(tr.phases.rollouts)},
        "norm": tr.rewards.norm.state_dict(),
    }
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):
    from hybrid_rl.rewards.tiny_model import random_reward_model_dir

    root = tmp_path_factory.mktemp("rm_ranks")
    rm_dir = random_reward_model_dir(str(root / "rm"))
    overrides = [
        f"model.path={tiny_model_dir}",
        "data.batch_size=4",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        f"trainer.out_dir={root / 'run'}",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        f"reward.model_path={rm_dir}",
        "reward.weights.rule=1",
        "reward.weights.model=0.5",
        "reward.normalize_model=true",
        "offload.reward_model=true",
        "reward.max_tokens_per_micro_batch=16",
    ]
    return rm_dir, run_ranks(_rank_fn, world=2, args=(tiny_model_dir, rm_dir, overrides), timeout=240)


def test_sharded_scores_equal_the_unsharded_model_and_offload_changes_no_bit(ranks):
    _, results = ranks
    for r in results:
        for offload in (False, True):
            assert r[offload]["sharded"] and r[offload]["frozen"]
            for scores in r[offload]["scores"]:
                torch.testing.assert_close(scores, r["reference"], rtol=0, atol=1e-5)
                assert torch.equal(scores, r[False]["scores"][0]), "offload must not change a bit of any score"
        # Two onloads (one per cycle) of this rank's shards and the (replicated) buffers.
        assert r[True]["moved"] == 2 * (r[True]["shard_bytes"] + r[True]["buffer_bytes"]) and r[False]["moved"] == 0
    assert results[0][False]["micro_batches"] == results[1][False]["micro_batches"] >= 3, (
        "the ranks agree on the number of micro-batch forwards (each is a collective)"
    )


def _plan(rm_dir: str, model_dir: str, offload: bool):
    from hybrid_rl.plan import memory as memory_plan

    arch = memory_plan.ModelArch.from_hf_config(os.path.join(model_dir, "config.json"))
    rm_arch = memory_plan.ModelArch.from_hf_config(os.path.join(rm_dir, "config.json"))
    flags = {"optimizer": False, "params": False, "ref": offload, "reward_model": offload}
    # The KV cache holds the prompt and every fed-back token: PROMPT + NEW - 1 positions.
    return memory_plan.plan_memory(
        arch,
        n_gpus=2,
        dtype="fp32",
        batch=2 * N_LOCAL,
        context=PROMPT + NEW - 1,
        offload=flags,
        reward_arch=rm_arch,
        gpu_mem_gib=1.0,
    )


@pytest.mark.parametrize("offload", [False, True])
def test_planner_bill_equals_the_ledger_for_every_role_and_phase(ranks, tiny_model_dir, offload):
    rm_dir, results = ranks
    plan = _plan(rm_dir, tiny_model_dir, offload)
    ledgers = [r[offload]["ledger"] for r in results]
    measured = sum(led["reward:ready"]["reward_model"] for led in ledgers)
    assert measured == plan.total["reward_model"] == plan.bill["reward_model"] > 0, (
        f"reward_model: ledger {measured} != planner {plan.total['reward_model']}"
    )
    for led, r in zip(ledgers, results):
        assert led["reward:ready"]["reward_model"] == r[offload]["shard_bytes"] > 0
        assert led["reward:ready"]["kv_cache"] == 0 and led["rollout:generated"]["kv_cache"] > 0
        for label in ("rollout:ready", "rollout:generated", "score:ready", "train:ready", "train:end"):
            assert (led[label]["reward_model"] == 0) == offload, label
    for phase, label in [
        ("train", "train:end"),
        ("rollout", "rollout:generated"),
        ("reward", "reward:ready"),
        ("score", "score:ready"),
    ]:
        got = sum(sum(led[label].values()) for led in ledgers)
        assert got == 2 * plan.phase_totals[phase], f"{phase}: ledger {got} != planner {2 * plan.phase_totals[phase]}"


def test_trainer_step_with_a_reward_model_on_two_ranks(ranks, tiny_model_dir):
    rm_dir, results = ranks
    m0, m1 = (r["trainer"]["metrics"] for r in results)
    for key in (
        "reward/mean",
        "reward/rule_mean",
        "reward/model_mean",
        "reward/model_std",
        "reward/model_norm_mean",
        "actor/loss",
        "actor/grad_norm",
    ):
        assert m0[key] == pytest.approx(m1[key], rel=1e-9, abs=1e-12), key
    assert m0["reward/model_std"] > 0
    assert m0["reward/mean"] == pytest.approx(m0["reward/rule_mean"] + 0.5 * m0["reward/model_norm_mean"], abs=1e-6)
    n0, n1 = (r["trainer"]["norm"] for r in results)
    assert n0 == n1 and n0["count"] == 4 * 2, "one running normaliser over both ranks' scores"
    plan = _plan(rm_dir, tiny_model_dir, offload=True)
    ledgers = [r["trainer"]["ledger"] for r in results]
    assert sum(led["reward:ready"]["reward_model"] for led in ledgers) == plan.total["reward_model"]
    assert all(led["score:ready"]["reward_model"] == 0 for led in ledgers)
