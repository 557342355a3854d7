"""Validation (hybrid_rl/loop/validation.py): greedy pass@1 and sampled mean@k / pass@k through the rollout
engine inside the phase switch's ROLLOUT phase, the samples file, when `fit` validates, and the
same numbers on two ranks as on one.

A tiny random model scores ~0 on GSM8K, so the reward here is a deterministic function of the
completion text (`parity_reward`), which makes the metrics non-trivial and checkable against the
completions written to val_samples.jsonl.
"""

from __future__ import annotations

import json
import os

import pytest

from hybrid_rl.config.load import load_config
from hybrid_rl.switch.phases import Phase
from hybrid_rl.trainer import Trainer
from hybrid_rl.types import SamplingParams
from tests.data_helpers import gsm8k_dir

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def parity_reward(prompts, completions, metadata):
    """1.0 when the completion's character codes sum to an even number (module-level: pickled to ranks)."""
    return [float(sum(map(ord, c)) % 2 == 0) for c in completions]


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory) -> str:
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir

    return build_tiny_text_model_dir(str(tmp_path_factory.mktemp("tiny_text") / "model"), max_positions=512)


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory) -> tuple[str, str]:
    """The first rows of the real GSM8K train and test files, as small jsonl files."""
    src, out = gsm8k_dir(), tmp_path_factory.mktemp("gsm8k_small")
    paths = []
    for split, n in (("train", 16), ("test", 5)):
        with open(os.path.join(src, f"{split}.jsonl")) as f:
            lines = [next(f) for _ in range(n)]
        (out / f"{split}.jsonl").write_text("".join(lines))
        paths.append(str(out / f"{split}.jsonl"))
    return paths[0], paths[1]


def _overrides(model_dir, files, out_dir, *extra):
    train, test = files
    return [
        f"model.path={model_dir}",
        "trainer.device=cpu",
        f"trainer.out_dir={out_dir}",
        "trainer.progress_bar=false",
        "data.task=jsonl",
        f"data.path={train}",
        f"data.val_path={test}",
        "data.prompt_key=question",
        "data.answer_key=answer",
        "data.batch_size=4",
        "data.val_batch_size=4",
        "rollout.n=2",
        "rollout.max_new_tokens=12",
        "trainer.total_steps=1",
        "trainer.log_every=0",
        *extra,
    ]


def _records(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "val_samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_validate_metrics_match_the_completions_it_wrote(text_model_dir, gsm8k_files, tmp_path, monkeypatch):
    cfg = load_config(
        None, _overrides(text_model_dir, gsm8k_files, tmp_path, "trainer.val_n=3", "trainer.val_sample_rows=100")
    )
    tr = Trainer(cfg, reward_fn=parity_reward)
    calls = []
    real_generate = tr.engine.generate
    monkeypatch.setattr(
        tr.engine, "generate", lambda ids, p: calls.append((ids, p, tr.phases.inside)) or real_generate(ids, p)
    )
    rollouts_before = tr.phases.rollouts
    m = tr.validator.run(7)

    # It went TRAIN -> ROLLOUT -> TRAIN through the phase switch, and generated only inside ROLLOUT.
    assert tr.phases.phase is Phase.TRAIN and tr.phases.inside is None
    assert tr.phases.rollouts == rollouts_before + 1
    assert all(inside is Phase.ROLLOUT for _, _, inside in calls)
    assert not tr.phases.pop_stats().seconds, "validation's switch time must not be billed to the next step"
    # Two batches (4 + 1 prompts), each: one greedy call, then one with 3 samples per prompt.
    assert [len(ids) for ids, _, _ in calls] == [4, 12, 1, 3]
    assert [p.greedy for _, p, _ in calls] == [True, False, True, False]
    assert calls[0][0] == [tr.encode(r["prompt"]) for r in tr.validator.rows[:4]]
    assert calls[1][0] == [ids for ids in calls[0][0] for _ in range(3)]

    recs = _records(tmp_path)
    assert len(recs) == 5 and {r["step"] for r in recs} == {7}
    assert [r["prompt"] for r in recs] == [r["prompt"] for r in tr.validator.rows]
    for r, row in zip(recs, tr.validator.rows):
        assert r["reward"] == parity_reward(None, [r["completion"]], None)[0]
        assert len(r["samples"]) == 3 and r["answer"] == row["answer"] and r["finish_reason"] in ("stop", "length")
    greedy = [r["reward"] for r in recs]
    sampled = [[s["reward"] for s in r["samples"]] for r in recs]
    assert m["val/pass@1"] == pytest.approx(sum(greedy) / 5)
    assert m["val/reward_mean"] == pytest.approx(sum(greedy) / 5)
    assert m["val/mean@3"] == pytest.approx(sum(map(sum, sampled)) / 15)
    assert m["val/pass@3"] == pytest.approx(sum(max(s) for s in sampled) / 5)
    assert m["val/prompts"] == 5 and m["val/response_length"] == pytest.approx(12.0, abs=12)
    assert 0 < m["val/mean@3"] < 1, "the parity reward should split 15 random completions"

    # Greedy decoding is deterministic: a second validation writes the same greedy completions.
    tr.validator.run(8)
    again = [r for r in _records(tmp_path) if r["step"] == 8]
    assert [r["completion"] for r in again] == [r["completion"] for r in recs]


def test_fit_validates_every_n_steps_at_the_end_and_before_training(text_model_dir, gsm8k_files, tmp_path):
    cfg = load_config(
        None,
        _overrides(
            text_model_dir,
            gsm8k_files,
            tmp_path,
            "trainer.total_steps=3",
            "trainer.val_every=2",
            "trainer.val_before_train=true",
            "trainer.val_sample_rows=2",
        ),
    )
    history = Trainer(cfg, reward_fn=parity_reward).fit()
    assert [("val/pass@1" in h) for h in history] == [False, True, True]  # step 2 (every 2) and 3 (the end)
    with open(tmp_path / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert "val/pass@1" in lines[0] and "reward/mean" not in lines[0]  # the initial policy, before any step
    assert [r["step"] for r in _records(tmp_path)] == [0, 0, 2, 2, 3, 3]  # val_sample_rows=2 per validation
    assert (tmp_path / "memory.txt").read_text().count("train:ready") == 1  # the report is a training step's


def test_greedy_validation_matches_a_direct_greedy_decode(text_model_dir, gsm8k_files, tmp_path):
    cfg = load_config(None, _overrides(text_model_dir, gsm8k_files, tmp_path, "trainer.val_sample_rows=5"))
    tr = Trainer(cfg, reward_fn=parity_reward)
    tr.validator.run(1)
    with tr.phases.rollout() as engine:
        direct = engine.generate(
            [tr.encode(r["prompt"]) for r in tr.validator.rows], SamplingParams(max_new_tokens=12, greedy=True)
        )
    with tr.phases.train():
        pass
    eos = tr.tokenizer.eos_token_id
    texts = tr.tokenizer.batch_decode(
        [c.token_ids[:-1] if c.token_ids[-1] == eos else c.token_ids for c in direct], skip_special_tokens=True
    )
    assert [r["completion"] for r in _records(tmp_path)] == texts


def _validate_on_rank(rank: int, overrides: list[str]):
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    tr = Trainer(load_config(None, overrides), reward_fn=parity_reward)
    return tr.validator.run(3)


@pytest.mark.slow
def test_two_ranks_report_what_one_rank_reports(text_model_dir, gsm8k_files, tmp_path):
    """5 prompts in batches of 4 over 2 ranks: slices of 2+2, then 1+0 (an empty generate on rank 1)."""
    from tests.distributed.launch import run_ranks

    overrides = _overrides(text_model_dir, gsm8k_files, tmp_path / "two", "trainer.val_n=2")
    two = run_ranks(_validate_on_rank, world=2, args=(overrides,))
    one = Trainer(
        load_config(None, _overrides(text_model_dir, gsm8k_files, tmp_path / "one")), reward_fn=parity_reward
    ).validator.run(3)
    for name in ("val/pass@1", "val/reward_mean", "val/response_length", "val/truncated", "val/prompts"):
        assert two[0][name] == two[1][name] == pytest.approx(one[name]), name
    assert two[0]["val/mean@2"] == two[1]["val/mean@2"]
    assert len(_records(tmp_path / "two")) == 3  # rank 0's slices (2 + 1) only


def test_conversational_rows_train_and_validate_with_the_system_prompt(
    text_model_dir, gsm8k_files, tmp_path, monkeypatch
):
    """GSM8K rows rewritten as verl writes them (a list of chat messages, the answer under
    reward_model.ground_truth): the engine gets the rendered conversation with data.system_prompt
    in front, in training and validation, and the reward gets the question text and the answer."""
    chat_files = []
    for name, path in zip(("train", "test"), gsm8k_files):
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        out = tmp_path / f"chat_{name}.jsonl"
        out.write_text(
            "".join(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": r["question"]}],
                        "reward_model": {"ground_truth": r["answer"]},
                    }
                )
                + "\n"
                for r in rows
            )
        )
        chat_files.append(str(out))
    overrides = [o for o in _overrides(text_model_dir, chat_files, tmp_path / "run") if not o.startswith("data.")]
    seen = []

    def reward(prompts, completions, metadata):
        seen.extend(zip(prompts, (m["answer"] for m in metadata)))
        return parity_reward(prompts, completions, metadata)

    cfg = load_config(
        None,
        [
            *overrides,
            "data.task=jsonl",
            f"data.path={chat_files[0]}",
            f"data.val_path={chat_files[1]}",
            "data.answer_key=reward_model.ground_truth",
            "data.batch_size=4",
            "data.val_batch_size=4",
            "data.system_prompt=Think step by step.",
        ],
    )
    tr = Trainer(cfg, reward_fn=reward)
    calls = []
    real_generate = tr.engine.generate
    monkeypatch.setattr(tr.engine, "generate", lambda ids, p: calls.append(ids) or real_generate(ids, p))
    tr.step()
    train_ids = calls[0][0]
    calls.clear()
    tr.validator.run(1)
    for ids, rows in ((train_ids, None), (calls[0][0], tr.validator.rows[0])):
        text = tr.tokenizer.decode(ids)
        assert text.startswith("<|im_start|>system\nThink step by step.<|im_end|>\n<|im_start|>user\n"), text
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        if rows is not None:
            assert rows["prompt"] in text and rows["messages"][-1]["content"] == rows["prompt"]
    questions = {
        json.loads(line)["prompt"][0]["content"]: json.loads(line)["reward_model"]["ground_truth"]
        for path in chat_files
        for line in open(path)
    }
    assert seen and all(questions[q] == a for q, a in seen), "rewards get the question text and its nested answer"
