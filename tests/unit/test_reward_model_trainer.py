"""A reward model in the loop, one process: the REWARD stage of the phase switch, the ledger's
`reward_model` role, offload round trips, the reward's parts and their metrics, the running
normaliser, and bad input at `Trainer(cfg)`.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_rl.config.load import load_config
from hybrid_rl.rewards.combine import RunningNorm, combine, resolve_weights
from hybrid_rl.rewards.model import RewardModelScorer, encode_texts, inspect_reward_model, load_reward_model
from hybrid_rl.rewards.tiny_model import random_reward_model_dir
from hybrid_rl.switch.phases import PhaseError, PhaseManager
from hybrid_rl.trainer import Trainer
from hybrid_rl.types import Completion

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return random_reward_model_dir(str(tmp_path_factory.mktemp("rm") / "cls"))


def _trainer(overrides, *extra, reward_fn=None) -> Trainer:
    return Trainer(load_config(None, [*overrides, *extra]), reward_fn=reward_fn)


def _reference_scores(path: str, prompts, texts) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    _, tok = inspect_reward_model(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([x])).logits[0, 0] for x in encode_texts(tok, prompts, texts)])


# ---------------------------------------------------------------------------- parts of the reward
def test_reward_is_the_weighted_sum_of_the_rule_and_the_models_score_of_the_text(
    tiny_trainer_overrides, rm_dir, tiny_tokenizer
):
    """Catches the model reading the policy's ids (or text with the stop token, or text whose special tokens
    were dropped: "8 <unk>" must not read as a finished "8"), a dropped weight, and a completion scored
    against another row's prompt."""
    tr = _trainer(
        tiny_trainer_overrides, f"reward.model_path={rm_dir}", "reward.weights.rule=0.5", "reward.weights.model=2.0"
    )  # rollout.n = 2
    rows = [{"prompt": "1 2 3 =", "answer": "234"}, {"prompt": "7 8 9 =", "answer": "890"}]

    def completion(text: str, stop: bool, extra: tuple = ()) -> Completion:
        ids = tiny_tokenizer(" ".join(text), add_special_tokens=False).input_ids + list(extra)
        ids = ids + [tiny_tokenizer.eos_token_id] if stop else ids
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop" if stop else "length")

    unk = tiny_tokenizer.unk_token_id
    completions = [
        completion("234", True),
        completion("230", False),
        completion("890", True),
        completion("8", True, extra=(unk,)),
    ]
    with tr.phases.rollout():
        reward_N, score_N, parts = tr.rollout_stage.score(rows, completions, model_phase=tr.phases.reward)
    rule_N = torch.tensor([1.0, 0.6, 1.0, 0.3])
    model_N = _reference_scores(
        rm_dir, ["1 2 3 =", "1 2 3 =", "7 8 9 =", "7 8 9 ="], ["2 3 4", "2 3 0", "8 9 0", "8 <unk>"]
    )
    torch.testing.assert_close(parts["rule"], rule_N)
    torch.testing.assert_close(parts["model"], model_N, rtol=0, atol=1e-5)
    torch.testing.assert_close(reward_N, 0.5 * rule_N + 2.0 * model_N, rtol=0, atol=1e-5)
    assert torch.equal(score_N, reward_N)
    assert tr.rewards.scorer.last_micro_batches == 1 and tr.rewards.norm is None


def test_combine_and_the_default_parts():
    r, m = torch.tensor([1.0, 0.0]), torch.tensor([3.0, -1.0])
    reward, logged = combine({"rule": r, "model": m}, {"rule": 0.5, "model": 2.0})
    assert torch.equal(reward, torch.tensor([6.5, -2.0])) and set(logged) == {"rule", "model"}
    reward, _ = combine({"rule": r, "model": m}, {"rule": 0.0, "model": 1.0})
    assert torch.equal(reward, m), "a part with weight 0 is logged, not added"
    with pytest.raises(ValueError, match="do not match"):
        combine({"rule": r}, {"rule": 1.0, "model": 1.0})
    assert resolve_weights({}, has_model=False) == {"rule": 1.0}
    assert resolve_weights({}, has_model=True) == {"model": 1.0}
    assert resolve_weights({"model": 1, "rule": 0.25}, has_model=True) == {"rule": 0.25, "model": 1.0}


def test_running_norm_matches_the_statistics_of_everything_seen_and_round_trips_as_json():
    g = torch.Generator().manual_seed(0)
    batches = [3.0 + 2.0 * torch.randn(n, generator=g) for n in (5, 8, 1, 13)]
    norm = RunningNorm()
    for i, b in enumerate(batches):
        norm.update(b)
        seen = torch.cat(batches[: i + 1]).double()
        assert norm.count == seen.numel()
        assert norm.mean == pytest.approx(seen.mean().item(), abs=1e-12)
        assert norm.std == pytest.approx(seen.std(unbiased=False).item(), abs=1e-12)
    out = norm.normalize(batches[-1])
    torch.testing.assert_close(out.double(), (batches[-1].double() - norm.mean) / norm.std)
    back = RunningNorm()
    back.load_state_dict(json.loads(json.dumps(norm.state_dict())))
    nxt = torch.tensor([10.0, -4.0])
    norm.update(nxt)
    back.update(nxt)
    assert back.state_dict() == norm.state_dict()
    reward, logged = combine({"model": nxt}, {"model": 1.0}, RunningNorm())
    assert torch.equal(reward, logged["model_norm"]) and torch.equal(logged["model"], nxt)
    torch.testing.assert_close(reward, torch.tensor([1.0, -1.0]))


# ---------------------------------------------------------------------------- the phase switch
def _manager(tiny_model, rm_dir, offload: bool, always_copy: bool = True):
    from hybrid_rl.rollout.native.engine import NativeEngine

    spec, tok = inspect_reward_model(rm_dir)
    rm = load_reward_model(spec, CPU, bf16=False)
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    pm = PhaseManager(
        tiny_model,
        opt,
        NativeEngine(tiny_model, pad_id=0, eos_id=1),
        CPU,
        reward_model=rm,
        offload_reward_model=offload,
        always_copy=always_copy,
    )
    return pm, RewardModelScorer(spec, tok, CPU, 64), rm


def test_reward_stage_rules(tiny_model, rm_dir):
    pm, _, _ = _manager(tiny_model, rm_dir, offload=False)
    with pytest.raises(PhaseError, match="inside the rollout phase"):
        with pm.reward():
            pass
    with pm.rollout():
        with pm.reward():
            with pytest.raises(PhaseError, match="while inside reward"):
                with pm.score():
                    pass
    with pm.train():
        pass
    # The KV cache is released for the REWARD stage (the reward model takes its place) and back after it.
    calls = []
    release, resume = pm.engine.release, pm.engine.resume
    pm.engine.release = lambda tags: (calls.append(("release", tuple(tags))), release(tags))[1]
    pm.engine.resume = lambda tags: (calls.append(("resume", tuple(tags))), resume(tags))[1]
    from hybrid_rl.types import SamplingParams

    with pm.rollout() as engine:
        calls.append("generated")
        with pm.reward():
            calls.append("reward")
            with pytest.raises(RuntimeError, match="released"):
                engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))  # a next round can decode again
    pm.engine.release, pm.engine.resume = release, resume
    assert calls == [
        ("resume", ("weights",)),
        ("resume", ("kv_cache",)),
        "generated",
        ("release", ("kv_cache",)),
        "reward",
        ("resume", ("kv_cache",)),
        ("release", ("kv_cache", "weights")),
    ]
    with pm.train():
        pass
    no_rm = PhaseManager(tiny_model, pm.optimizer, pm.engine, CPU)
    with no_rm.rollout():
        with pytest.raises(PhaseError, match="no reward model"):
            with no_rm.reward():
                pass


def test_offloaded_reward_model_is_restored_bit_for_bit(tiny_model, rm_dir):
    """Catches an onload that is skipped or restores the wrong tensors: while the model is offloaded its
    device tensors are overwritten, and the next REWARD stage must score exactly as without offload."""
    from hybrid_rl.types import SamplingParams

    prompts, texts = ["1 2 3 =", "4 5 6 =", "7 8 9 ="], ["2 3 4", "5 6", ""]
    plain, scorer, _ = _manager(tiny_model, rm_dir, offload=False)
    with plain.rollout():
        with plain.reward() as rm:
            want = scorer(rm, prompts, texts)
    pm, scorer, rm_module = _manager(tiny_model, rm_dir, offload=True)
    n_bytes = sum(p.numel() * p.element_size() for p in rm_module.parameters())
    n_bytes += sum(b.numel() * b.element_size() for b in rm_module.buffers())
    for _ in range(2):
        with torch.no_grad():
            for t in [*rm_module.parameters(), *rm_module.buffers()]:
                t.fill_(float("nan"))  # what the device holds while the model is on the host
        with pm.rollout() as engine:
            engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, seed=0))
            with pm.reward() as rm:
                got = scorer(rm, prompts, texts)
        assert torch.equal(got, want)
        with pm.train():
            pass
    stats = pm.pop_stats()
    assert stats.bytes["onload_reward_model"] == stats.bytes["offload_reward_model"] == 2 * n_bytes
    snaps = {s.label: s.roles for s in pm.ledger.rollout_snapshots(pm.rollouts)}
    rm_param_bytes = sum(p.numel() * p.element_size() for p in rm_module.parameters())
    assert snaps["reward:ready"]["reward_model"] == rm_param_bytes
    for label in ("rollout:ready", "rollout:generated", "train:ready", "train:end"):
        assert snaps[label]["reward_model"] == 0, label
    assert snaps["reward:ready"]["kv_cache"] == 0, "the KV cache is released for the REWARD stage"
    assert snaps["rollout:generated"]["kv_cache"] > 0, "the ledger keeps the rollout's KV peak"


# ---------------------------------------------------------------------------- the trainer
def test_trainer_logs_each_part_and_keeps_the_reward_model_off_device_outside_its_stage(tiny_trainer_overrides, rm_dir):
    tr = _trainer(
        tiny_trainer_overrides,
        f"reward.model_path={rm_dir}",
        "reward.weights.rule=1",
        "reward.weights.model=0.5",
        "reward.normalize_model=true",
        "offload.reward_model=true",
        "trainer.total_steps=2",
    )
    assert tr.offload.reward_model and tr.phases.rm_offload is not None
    assert all(not p.requires_grad for p in tr.rewards.module.parameters())
    history = tr.fit()
    m = history[-1]
    for key in (
        "reward/rule_mean",
        "reward/rule_std",
        "reward/model_mean",
        "reward/model_std",
        "reward/model_norm_mean",
        "switch/onload_reward_model_s",
        "memory/reward_model_peak",
    ):
        assert key in m, key
    assert m["reward/mean"] == pytest.approx(m["reward/rule_mean"] + 0.5 * m["reward/model_norm_mean"], abs=1e-6)
    assert tr.rewards.norm.count == 2 * 4 * 2, "every score of both steps (batch 4 x n 2)"
    json.dumps(tr.rewards.norm.state_dict())
    snaps = {s.label: s.roles for s in tr.phases.ledger.rollout_snapshots(tr.phases.rollouts)}
    rm_bytes = sum(p.numel() * p.element_size() for p in tr.rewards.module.parameters())
    assert snaps["reward:ready"]["reward_model"] == rm_bytes == m["memory/reward_model_peak"]
    assert [k for k, v in snaps.items() if v["reward_model"]] == ["reward:ready"]


def test_dynamic_sampling_scores_every_round_and_a_zero_weight_only_logs(tiny_trainer_overrides, rm_dir):
    tr = _trainer(
        tiny_trainer_overrides,
        f"reward.model_path={rm_dir}",
        "reward.weights.rule=1",
        "reward.weights.model=0",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=3",
        "trainer.total_steps=2",
    )
    history = tr.fit()
    assert max(m["sampling/rounds"] for m in history) >= 2, "the test needs a step with a second round"
    for m in history:
        # No validation: the phase switch's rollout count is the step (one ROLLOUT phase per step).
        labels = [s.label for s in tr.phases.ledger.snapshots if s.rollout == int(m["step"])]
        assert labels.count("reward:ready") == m["sampling/rounds"], "one REWARD stage per sampling round"
        assert m["reward/mean"] == pytest.approx(m["reward/rule_mean"]), "weight 0: the model score is only logged"
        assert m["reward/model_std"] > 0


def test_a_reward_model_alone_needs_no_rule(tiny_trainer_overrides, rm_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} {i} ="}) + "\n" for i in range(8)))
    tr = _trainer(tiny_trainer_overrides, f"reward.model_path={rm_dir}", "data.task=jsonl", f"data.path={rows}")
    assert tr.rewards.weights == {"model": 1.0}
    m = tr.fit()[-1]
    assert "reward/rule_mean" not in m and m["reward/mean"] == pytest.approx(m["reward/model_mean"])
    assert "reward/accuracy" not in m, "a model's score has no threshold of 'correct'"


# ---------------------------------------------------------------------------- bad input
def test_bad_reward_model_fails_before_the_policy_loads(tiny_trainer_overrides, rm_dir, tmp_path, no_model_build):
    with pytest.raises(ValueError, match=r"'reward.model_path'.*does not exist"):
        _trainer(tiny_trainer_overrides, f"reward.model_path={tmp_path / 'nope'}")
    causal = random_reward_model_dir(str(tmp_path / "clm"), kind="causal_lm")
    with pytest.raises(ValueError, match=r"not a sequence-classification reward model.*reward.score_token"):
        _trainer(tiny_trainer_overrides, f"reward.model_path={causal}")
    with pytest.raises(ValueError, match=r"'reward.weights'.*reward_fn"):
        _trainer(tiny_trainer_overrides, f"reward.model_path={rm_dir}", reward_fn=lambda p, c, m: [0.0] * len(c))
    with pytest.raises(ValueError, match=r"'reward.weights'.*reward.model_path is empty"):
        load_config(None, ["reward.weights.model=1"])
    with pytest.raises(ValueError, match=r"'reward.max_tokens_per_micro_batch'"):
        load_config(None, [f"reward.model_path={rm_dir}", "reward.max_tokens_per_micro_batch=0"])


def test_a_reward_model_that_scores_nan_fails_before_the_first_step(tiny_trainer_overrides, rm_dir, tmp_path):
    import shutil

    bad = shutil.copytree(rm_dir, tmp_path / "nan_rm")
    weights = next(f for f in os.listdir(bad) if f.endswith(".safetensors"))
    state = load_file(os.path.join(bad, weights))
    state["score.weight"] = torch.full_like(state["score.weight"], math.nan)
    save_file(state, os.path.join(bad, weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"scored nan for completion 0 \(''.*scores must be finite"):
        _trainer(tiny_trainer_overrides, f"reward.model_path={bad}")
