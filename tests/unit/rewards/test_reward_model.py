"""The reward-model scorer (rewards/model.py), its checks, the reward's parts (rewards/combine.py), and
the planner's count of a classifier (plan/memory.py). One process, tiny models built in code.

The reference for every score is a plain Hugging Face forward of ONE sequence, tokenized by the
reward model's own tokenizer and chat template, with the model loaded by transformers alone.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from hybrid_rl.rewards.model import (
    RewardModelScorer,
    check_scores,
    encode_texts,
    inspect_reward_model,
    load_reward_model,
)
from hybrid_rl.rewards.tiny_model import CHAT_TEMPLATE, SCORE_TOKEN, random_reward_model_dir

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CPU = torch.device("cpu")
PROMPTS = ["1 2 3 =", "4 5 6 =", "7 8 9 =", "0 0 1 =", "1 2 3 =", "9 9 9 ="]
COMPLETIONS = ["2 3 4", "5", "8 9 0 1", "", "1 = 1", "0 0 0"]


def _edit_json(path: str, **changes) -> None:
    data = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    json.dump(data, open(path, "w"))


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_models")
    dirs = {
        "classifier": random_reward_model_dir(str(root / "cls")),
        "causal_lm": random_reward_model_dir(str(root / "clm"), kind="causal_lm"),
        "three_labels": random_reward_model_dir(str(root / "cls3"), num_labels=3, seed=1),
        "no_template": random_reward_model_dir(str(root / "plain"), chat_template=False, seed=2),
    }
    # Pad = the template's last token (as in reward models whose pad is their EOS): "the rightmost
    # token that is not pad" is then the wrong one; the score must still be read at the last token.
    pad_end = shutil.copytree(dirs["classifier"], root / "pad_end")
    _edit_json(os.path.join(pad_end, "tokenizer_config.json"), pad_token="<|end|>")
    _edit_json(os.path.join(pad_end, "config.json"), pad_token_id=4)
    dirs["pad_is_end"] = str(pad_end)
    return dirs


def _reference(path: str, kind: str, index: int, ids: list[list[int]]) -> torch.Tensor:
    """One unpadded sequence at a time through the model as transformers loads it (no pad id: for a
    single sequence transformers then reads the classifier's logits at the last token)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32, pad_token_id=None).eval()
    assert model.config.pad_token_id is None
    with torch.no_grad():
        out = [model(input_ids=torch.tensor([x])).logits for x in ids]
    return torch.stack([o[0, index] if kind == "classifier" else o[0, -1, index] for o in out])


def _scorer(path: str, budget: int = 4096, **kw):
    spec, tok = inspect_reward_model(path, **kw)
    return RewardModelScorer(spec, tok, CPU, budget), load_reward_model(spec, CPU, bf16=False), spec, tok


# ---------------------------------------------------------------------------- scores
def test_classifier_scores_equal_one_sequence_forwards_on_its_own_tokens(rm_dirs, tiny_tokenizer):
    scorer, module, spec, tok = _scorer(rm_dirs["classifier"])
    assert spec.kind == "classifier" and spec.index == 0 and spec.chat_template
    assert all(not p.requires_grad for p in module.parameters()) and not module.training, "frozen, eval"
    score_N = scorer(module, PROMPTS, COMPLETIONS)
    ids = encode_texts(tok, PROMPTS, COMPLETIONS)
    # The reward model's chat template: the prompt as the user turn, the completion as the assistant turn.
    assert tok.convert_ids_to_tokens(ids[0]) == [
        "<|user|>",
        "1",
        "2",
        "3",
        "=",
        "<|assistant|>",
        "2",
        "3",
        "4",
        "<|end|>",
    ]
    torch.testing.assert_close(score_N, _reference(rm_dirs["classifier"], "classifier", 0, ids), rtol=0, atol=1e-5)
    assert score_N.std() > 1e-3, "a random model still scores completions differently (the test needs it)"
    # The policy's ids for the same text are other tokens entirely: reading them would give other scores.
    policy_ids = [tiny_tokenizer(p + " " + c, add_special_tokens=False).input_ids for p, c in zip(PROMPTS, COMPLETIONS)]
    wrong = _reference(rm_dirs["classifier"], "classifier", 0, policy_ids)
    assert (wrong - score_N).abs().max() > 1e-2


def test_the_score_is_read_at_the_last_token_even_when_it_is_the_pad_token(rm_dirs):
    scorer, module, _, tok = _scorer(rm_dirs["pad_is_end"])
    ids = encode_texts(tok, PROMPTS, COMPLETIONS)
    assert tok.pad_token_id == 4 and all(x[-1] == 4 for x in ids)
    torch.testing.assert_close(
        scorer(module, PROMPTS, COMPLETIONS), _reference(rm_dirs["pad_is_end"], "classifier", 0, ids), rtol=0, atol=1e-5
    )


def test_causal_lm_reward_model_scores_the_chosen_tokens_logit(rm_dirs):
    scorer, module, spec, tok = _scorer(rm_dirs["causal_lm"], score_token=SCORE_TOKEN)
    assert spec.kind == "causal_lm" and spec.index == tok.convert_tokens_to_ids(SCORE_TOKEN)
    score_N = scorer(module, PROMPTS, COMPLETIONS)
    ref = _reference(rm_dirs["causal_lm"], "causal_lm", spec.index, encode_texts(tok, PROMPTS, COMPLETIONS))
    torch.testing.assert_close(score_N, ref, rtol=0, atol=1e-6)
    by_id, module2, _, _ = _scorer(rm_dirs["causal_lm"], score_token_id=spec.index)
    assert torch.equal(by_id(module2, PROMPTS, COMPLETIONS), score_N)


def test_a_classifier_with_several_labels_scores_the_chosen_label(rm_dirs):
    with pytest.raises(ValueError, match=r"'reward.score_index'.*3 labels"):
        inspect_reward_model(rm_dirs["three_labels"])
    with pytest.raises(ValueError, match=r"'reward.score_index'.*out of range"):
        inspect_reward_model(rm_dirs["three_labels"], score_index=3)
    scorer, module, _, tok = _scorer(rm_dirs["three_labels"], score_index=2)
    ref = _reference(rm_dirs["three_labels"], "classifier", 2, encode_texts(tok, PROMPTS, COMPLETIONS))
    torch.testing.assert_close(scorer(module, PROMPTS, COMPLETIONS), ref, rtol=0, atol=1e-5)


def test_without_a_chat_template_the_model_reads_prompt_plus_completion(rm_dirs):
    scorer, module, spec, tok = _scorer(rm_dirs["no_template"])
    assert not spec.chat_template
    ids = encode_texts(tok, ["1 2 ="], [" 3 4"])
    assert tok.convert_ids_to_tokens(ids[0]) == ["1", "2", "=", "3", "4"]
    ref = _reference(rm_dirs["no_template"], "classifier", 0, encode_texts(tok, PROMPTS, COMPLETIONS))
    torch.testing.assert_close(scorer(module, PROMPTS, COMPLETIONS), ref, rtol=0, atol=1e-5)


def test_micro_batches_keep_to_the_token_budget_and_leave_scores_unchanged(rm_dirs):
    big, module, _, tok = _scorer(rm_dirs["classifier"])
    small = RewardModelScorer(big.spec, tok, CPU, max_tokens_per_micro_batch=24)
    shapes = []
    hook = module.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        whole = big(module, PROMPTS, COMPLETIONS)
        assert shapes == [(6, 11)] and big.last_micro_batches == 1
        shapes.clear()
        split = small(module, PROMPTS, COMPLETIONS)
    finally:
        hook.remove()
    assert small.last_micro_batches == len(shapes) >= 3
    assert all(rows * length <= 24 or rows == 1 for rows, length in shapes), shapes
    assert sum(rows for rows, _ in shapes) == 6
    # Left padding with real-token positions: the grouping changes no score beyond rounding.
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-5)


def test_a_nan_or_infinite_score_names_the_sample():
    with pytest.raises(ValueError, match=r"scored nan for completion 1 \('bad'.*of prompt 'q1'.*1 more"):
        check_scores(torch.tensor([0.0, math.nan, math.inf]), ["q0", "q1", "q2"], ["ok", "bad", "worse"], "/rm")


def test_an_input_longer_than_the_reward_models_positions_names_the_sample(rm_dirs, tmp_path):
    short = shutil.copytree(rm_dirs["no_template"], tmp_path / "short_context")
    _edit_json(os.path.join(short, "config.json"), max_position_embeddings=4)
    scorer, module, spec, _ = _scorer(str(short))
    assert spec.max_positions == 4
    assert scorer(module, ["1 2"], [" 3"]).shape == (1,), "3 tokens fit"
    with pytest.raises(
        ValueError,
        match=r"completion 1 \(' 3 4 5'.*5 tokens.*max_position_embeddings 4; lower "
        r"rollout\.max_new_tokens",
    ):
        scorer(module, ["1 2", "1 2"], [" 3", " 3 4 5"])


# ---------------------------------------------------------------------------- bad directories
def test_bad_reward_model_directories_name_what_to_fix(rm_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"'reward.model_path'.*does not exist"):
        inspect_reward_model(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"'reward.model_path'.*no config.json"):
        inspect_reward_model(str(empty))
    with pytest.raises(
        ValueError,
        match=r"causal LM \(LlamaForCausalLM\), not a sequence-classification.*"
        r"reward.score_token",
    ):
        inspect_reward_model(rm_dirs["causal_lm"])
    with pytest.raises(ValueError, match=r"'reward.score_token'.*sequence classifier"):
        inspect_reward_model(rm_dirs["classifier"], score_token=SCORE_TOKEN)
    with pytest.raises(ValueError, match=r"'reward.score_token'.*exactly one known token"):
        inspect_reward_model(rm_dirs["causal_lm"], score_token="yes no")
    with pytest.raises(ValueError, match=r"'reward.score_token_id'.*outside"):
        inspect_reward_model(rm_dirs["causal_lm"], score_token_id=10_000)
    bert = shutil.copytree(rm_dirs["classifier"], tmp_path / "bert")
    _edit_json(os.path.join(bert, "config.json"), architectures=["BertModel"])
    with pytest.raises(ValueError, match=r"BertModel, not a sequence-classification model"):
        inspect_reward_model(str(bert))
    no_pad = shutil.copytree(rm_dirs["classifier"], tmp_path / "no_pad")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(no_pad, name)):
            _edit_json(os.path.join(no_pad, name), pad_token=None)
    with pytest.raises(ValueError, match=r"no pad token.*pad_token"):
        inspect_reward_model(str(no_pad))
    no_weights = shutil.copytree(rm_dirs["classifier"], tmp_path / "no_weights")
    for f in os.listdir(no_weights):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(no_weights, f))
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        inspect_reward_model(str(no_weights))


def test_the_chat_template_of_the_tiny_reward_model_is_saved_with_it(rm_dirs):
    _, tok = inspect_reward_model(rm_dirs["classifier"])
    assert tok.chat_template == CHAT_TEMPLATE


# ---------------------------------------------------------------------------- the planner counts a classifier
@pytest.mark.parametrize("which", ["classifier", "causal_lm", "three_labels"])
def test_planner_counts_the_reward_models_parameters_exactly(rm_dirs, which):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hybrid_rl.plan.memory import ModelArch, count_parameters

    arch = ModelArch.from_hf_config(rm_dirs[which])
    cls = AutoModelForCausalLM if which == "causal_lm" else AutoModelForSequenceClassification
    model = cls.from_pretrained(rm_dirs[which])
    assert arch.num_labels == {"classifier": 1, "causal_lm": 0, "three_labels": 3}[which]
    assert count_parameters(arch) == sum(p.numel() for p in model.parameters())


def test_reward_stage_residency_in_the_plan():
    from hybrid_rl.plan.memory import PHASES, builtin_arch, plan_memory

    a, rm = builtin_arch("Qwen2.5-1.5B"), builtin_arch("Qwen2.5-0.5B")
    assert PHASES.index("rollout") < PHASES.index("reward") < PHASES.index("score")
    off = plan_memory(a, 4, "bf16", 16, 1024, {"optimizer": True, "ref": True, "reward_model": True}, reward_arch=rm)
    assert set(off.phases["reward"]) == {"policy_weights", "engine_weights", "reward_model"}, "no KV cache"
    for p in ("train", "rollout", "score"):
        assert "reward_model" not in off.phases[p], p
    on = plan_memory(a, 4, "bf16", 16, 1024, {"optimizer": True, "ref": True}, reward_arch=rm)
    assert all("reward_model" in on.phases[p] for p in PHASES)
    assert on.phase_totals["reward"] == on.phase_totals["rollout"] - on.per_gpu["kv_cache"]
    rule_only = plan_memory(a, 4, "bf16", 16, 1024)
    assert rule_only.phases["reward"] == {} and rule_only.phase_totals["reward"] == 0, "a stage that never happens"


def test_cli_shows_the_reward_column_only_with_a_reward_model(capsys):
    from hybrid_rl.plan.cli import main

    main(["--model", "Qwen2.5-7B", "--gpus", "8", "--batch", "256", "--context", "4096"])
    without = capsys.readouterr().out.splitlines()
    main(
        [
            "--model",
            "Qwen2.5-7B",
            "--reward-model",
            "Qwen2.5-7B",
            "--gpus",
            "8",
            "--batch",
            "256",
            "--context",
            "4096",
            "--offload",
            "reward_model",
        ]
    )
    with_rm = capsys.readouterr().out.splitlines()
    assert "reward" not in without[5] and without[5].split()[-2] == "score"
    assert with_rm[5].split()[-3:-1] == ["reward", "score"]
    rm_row = next(line for line in with_rm if line.startswith("reward_model"))
    assert rm_row.split()[-4:] == ["cpu", "cpu", "1.90", "cpu"], rm_row
    assert json.loads(with_rm[-1])["bill"]["reward_model"] == 2 * 7_615_616_512
