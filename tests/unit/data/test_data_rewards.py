"""Prompt data (rows, GSM8K, files and validation splits, chat templates, the rank-aware loader and its state_dict),
the reward registry and the digits reward.

Legend: B global batch (prompts per step), W ranks.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from hybrid_rl.data.digits import DIGIT_WORDS, digits_rows
from hybrid_rl.data.prompts import PromptLoader, load_rows
from hybrid_rl.rewards import base as reward_base
from hybrid_rl.rewards.base import compute_rewards, get_reward, register_reward
from hybrid_rl.rewards.toy import digits_reward


def _rows(n):
    return [{"prompt": f"p{i}", "id": i} for i in range(n)]


def _ids(batch):
    return [r["id"] for r in batch]


# ---------------------------------------------------------------------------- PromptLoader
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_slices_are_disjoint_and_cover_the_global_batch(world):
    rows, B, steps = _rows(44), 8, 13  # 5 batches per epoch (4 rows skipped): crosses two epoch boundaries
    whole = PromptLoader(rows, B, rank=0, world_size=1, seed=3)
    ranks = [PromptLoader(rows, B, rank=r, world_size=world, seed=3) for r in range(world)]
    for step in range(steps):
        glob = _ids(whole.next_batch())
        parts = [_ids(l.next_batch()) for l in ranks]
        assert all(len(p) == B // world for p in parts)
        flat = [i for p in parts for i in p]
        assert len(set(flat)) == len(flat), f"step {step}: ranks overlap"
        assert flat == glob, f"step {step}: rank slices in rank order are the global batch"


def test_one_epoch_visits_each_row_at_most_once_and_reshuffles():
    rows, B = _rows(44), 8
    loader = PromptLoader(rows, B, seed=0)
    epoch0 = [i for _ in range(5) for i in _ids(loader.next_batch())]
    epoch1 = [i for _ in range(5) for i in _ids(loader.next_batch())]
    assert len(set(epoch0)) == 40 and len(set(epoch1)) == 40  # the 4-row tail of each epoch is skipped
    assert loader.epoch == 1
    assert epoch0 != epoch1  # a new permutation per epoch
    assert epoch0 != list(range(40))  # shuffled


def test_seed_changes_order():
    a = _ids(PromptLoader(_rows(64), 8, seed=0).next_batch())
    b = _ids(PromptLoader(_rows(64), 8, seed=1).next_batch())
    assert a != b


@pytest.mark.parametrize("warmup", [0, 2, 5, 7])
def test_state_dict_resumes_the_same_sequence(warmup):
    rows, B, W = _rows(44), 8, 2
    ref = [PromptLoader(rows, B, rank=r, world_size=W, seed=9) for r in range(W)]
    for _ in range(warmup):
        for l in ref:
            l.next_batch()
    states = [json.loads(json.dumps(l.state_dict())) for l in ref]  # JSON round trip, as a checkpoint file would be
    expected = [[_ids(l.next_batch()) for l in ref] for _ in range(8)]
    # A fresh loader (different seed argument: the state carries the seed) resumes exactly.
    resumed = [PromptLoader(rows, B, rank=r, world_size=W, seed=123) for r in range(W)]
    for l, s in zip(resumed, states):
        l.load_state_dict(s)
    got = [[_ids(l.next_batch()) for l in resumed] for _ in range(8)]
    assert got == expected
    assert resumed[0].state_dict() == ref[0].state_dict()


def test_loader_bad_sizes():
    with pytest.raises(ValueError, match="data.batch_size=6 does not divide over 4 ranks"):
        PromptLoader(_rows(20), 6, rank=0, world_size=4)
    with pytest.raises(ValueError, match="fewer than data.batch_size=8"):
        PromptLoader(_rows(5), 8)


# ---------------------------------------------------------------------------- rows
def test_digits_rows_are_well_formed_and_seeded():
    rows = digits_rows(200, seed=1)
    assert rows == digits_rows(200, seed=1) and rows != digits_rows(200, seed=2)
    for r in rows:
        words = r["prompt"].split()
        assert len(words) == 4 and words[-1] == "=" and all(w in DIGIT_WORDS for w in words)
        assert r["answer"] == "".join(str((int(d) + 1) % 10) for d in words[:3])
    assert any("9" in r["prompt"] and "0" in r["answer"] for r in rows)  # wrap-around happens


def test_load_rows_digits_and_jsonl(tmp_path):
    rows = load_rows("digits", num_prompts=10, seed=4)
    assert len(rows) == 10 and rows == digits_rows(10, 4)
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "a b", "answer": "1"}\n\n{"question": "c", "extra": [1]}\n')
    rows = load_rows("jsonl", str(path), prompt_key="question")
    assert rows == [{"question": "a b", "answer": "1", "prompt": "a b"}, {"question": "c", "extra": [1], "prompt": "c"}]
    with pytest.raises(ValueError, match="data.task"):
        load_rows("nope")


# ---------------------------------------------------------------------------- digits reward
def _score(answer, text, finish_reason, response_tokens):
    meta = {"answer": answer, "finish_reason": finish_reason, "response_tokens": response_tokens}
    return digits_reward(["x ="], [text], [meta])[0]


@pytest.mark.parametrize(
    "text,finish,n_tok,expected",
    [
        ("2 3 4", "stop", 3, 1.0),  # right answer, then EOS
        ("2 3 4", "length", 3, 0.9),  # right digits, never stopped
        ("2 3 4 5", "stop", 4, 0.9),  # right digits but stopped late
        ("2 3 5", "length", 3, 0.6),  # 2 of 3 digits
        ("2 3 5", "stop", 3, 0.7),  # 2 of 3 digits + stop
        ("2", "stop", 1, 0.3),  # one digit, stopped too early
        ("", "stop", 0, 0.0),
        ("4 3 2", "length", 3, 0.3),  # only the middle digit in place
        ("9 9 9", "stop", 3, 0.1),  # nothing right, but stopped after three tokens
    ],
)
def test_digits_reward_hand_examples(text, finish, n_tok, expected):
    assert _score("234", text, finish, n_tok) == pytest.approx(expected, abs=1e-12)


def test_digits_reward_is_registered_and_checked():
    spec = get_reward("digits")
    assert spec.fn is digits_reward and spec.success_threshold == 1.0
    meta = [{"answer": "234", "finish_reason": "stop", "response_tokens": 3}] * 2
    assert compute_rewards("digits", spec, ["a", "b"], ["2 3 4", "0 0 0"], meta) == pytest.approx([1.0, 0.1])


def test_a_user_reward_registered_by_decorator_is_found_and_names_are_unique(monkeypatch):
    # A copy of the registry, so the names registered here do not leak into other tests.
    monkeypatch.setattr(reward_base, "_REGISTRY", dict(reward_base._REGISTRY))

    @register_reward("exact_match", success_threshold=0.5)
    def exact_match(prompts, completions, metadata):
        return [float(c.strip() == m["answer"]) for c, m in zip(completions, metadata)]

    spec = get_reward("exact_match")
    assert spec.fn is exact_match and spec.success_threshold == 0.5
    assert get_reward("digits").fn is digits_reward, "the built-ins are still registered alongside"

    # A notebook cell run again defines the same function anew: it replaces the old definition.
    @register_reward("exact_match", success_threshold=0.5)
    def exact_match(prompts, completions, metadata):  # noqa: F811
        return [0.0 for _ in completions]

    assert get_reward("exact_match").fn is exact_match
    with pytest.raises(ValueError, match=r"already registered \(by hybrid_rl.rewards.toy.digits_reward\).*reward_fn="):
        register_reward("digits")(exact_match)

    def other(prompts, completions, metadata):
        return [1.0 for _ in completions]

    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match")(other)
    with pytest.raises(ValueError, match="reward.name"):
        get_reward("no_such_reward")


def test_uniform_random_policy_scores_at_most_0_1(tiny_tokenizer):
    """Uniform sampling over the whole vocabulary, decoded the way the trainer decodes, earns <= 0.1."""
    tok, rng = tiny_tokenizer, random.Random(0)
    V, eos, max_new, n = len(tok), tok.eos_token_id, 16, 4000
    rows = digits_rows(n, seed=5)
    bodies, metas = [], []
    for row in rows:
        ids = []
        for _ in range(max_new):
            t = rng.randrange(V)
            ids.append(t)
            if t == eos:
                break
        stopped = ids[-1] == eos
        body = ids[:-1] if stopped else ids
        bodies.append(body)
        metas.append({**row, "finish_reason": "stop" if stopped else "length", "response_tokens": len(body)})
    texts = tok.batch_decode(bodies, skip_special_tokens=True)
    rewards = compute_rewards("digits", get_reward("digits"), [r["prompt"] for r in rows], texts, metas)
    mean = sum(rewards) / n
    assert 0.03 < mean <= 0.1, mean  # about 0.075 here; 0 would mean nothing decodes
    # Sanity of the pipeline: the decoded text of a perfect answer earns 1.0.
    row = rows[0]
    perfect = tok(" ".join(row["answer"]), add_special_tokens=False).input_ids
    text = tok.decode(perfect, skip_special_tokens=True)
    assert compute_rewards(
        "digits",
        get_reward("digits"),
        [row["prompt"]],
        [text],
        [{**row, "finish_reason": "stop", "response_tokens": len(perfect)}],
    ) == [1.0]


# ---------------------------------------------------------------------------- GSM8K, files, validation splits
def _data(**kw):
    from hybrid_rl.config.schema import DataConfig

    return DataConfig(**kw)


def test_gsm8k_from_the_shared_copy_beside_the_repo():
    from hybrid_rl.data.gsm8k import INSTRUCTION, default_dirs
    from hybrid_rl.data.prompts import load_datasets
    from tests.data_helpers import gsm8k_dir

    gsm8k_dir()

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert default_dirs()[0] == os.path.normpath(os.path.join(repo, "..", "shared", "data", "gsm8k"))
    ds = load_datasets(_data(task="gsm8k"))
    assert (len(ds.train), len(ds.val)) == (7473, 1319)  # openai/gsm8k "main": train 7,473, test 1,319
    assert ds.train_source.endswith(os.path.join("gsm8k", "train.jsonl"))
    assert ds.val_source.endswith(os.path.join("gsm8k", "test.jsonl"))
    first = ds.val[0]
    assert first["question"].startswith("Janet") and first["ground_truth"] == "18"
    assert first["prompt"] == f"{first['question']} {INSTRUCTION}"
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    assert sum(r["ground_truth"] == "1,200" for r in ds.train + ds.val) >= 1  # kept as written; the reward parses it
    assert len(load_datasets(_data(task="gsm8k", num_prompts=10, instruction="")).train) == 10
    assert load_datasets(_data(task="gsm8k", instruction="")).train[0]["prompt"] == ds.train[0]["question"]


def test_gsm8k_from_the_hub_when_there_is_no_local_copy(monkeypatch, tmp_path):
    import sys
    import types

    from hybrid_rl.data import gsm8k
    from hybrid_rl.data.prompts import load_datasets

    monkeypatch.setattr(gsm8k, "default_dirs", lambda: [str(tmp_path / "nowhere")])
    with pytest.raises(FileNotFoundError) as err:  # no local copy and no `datasets`: say what was tried
        monkeypatch.setitem(sys.modules, "datasets", None)
        load_datasets(_data(task="gsm8k"))
    assert "nowhere" in str(err.value) and "openai/gsm8k" in str(err.value) and "data.path" in str(err.value)
    calls = []
    fake = types.SimpleNamespace(
        load_dataset=lambda *a: (
            calls.append(a)
            or {
                "train": [{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "#### 2"}],
                "test": [{"question": "t1", "answer": "#### 3"}],
            }
        )
    )
    monkeypatch.setitem(sys.modules, "datasets", fake)
    ds = load_datasets(_data(task="gsm8k"))
    assert calls == [("openai/gsm8k", "main")]
    assert [r["ground_truth"] for r in ds.train] == ["1", "2"] and ds.val[0]["question"] == "t1"
    assert ds.train_source == "openai/gsm8k:train"


def test_jsonl_with_answer_key_instruction_and_held_out_split(tmp_path):
    from hybrid_rl.data.prompts import load_datasets

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"problem": f"p{i}", "solution": str(i)}) + "\n" for i in range(20)))
    ds = load_datasets(
        _data(
            task="jsonl",
            path=str(path),
            prompt_key="problem",
            answer_key="solution",
            instruction="Answer:",
            val_split=0.25,
            seed=3,
        )
    )
    assert (len(ds.train), len(ds.val)) == (15, 5)
    assert {r["problem"] for r in ds.train}.isdisjoint({r["problem"] for r in ds.val})
    assert all(r["prompt"] == f"{r['problem']} Answer:" and r["answer"] == r["solution"] for r in ds.train + ds.val)
    again = load_datasets(_data(task="jsonl", path=str(path), prompt_key="problem", val_split=0.25, seed=3))
    assert [r["problem"] for r in again.val] == [r["problem"] for r in ds.val]  # the seed decides the split
    other = load_datasets(_data(task="jsonl", path=str(path), prompt_key="problem", val_split=0.25, seed=4))
    assert [r["problem"] for r in other.val] != [r["problem"] for r in ds.val]
    with pytest.raises(ValueError, match="data.val_split=0.01 of 20 rows leaves 0"):
        load_datasets(_data(task="jsonl", path=str(path), prompt_key="problem", val_split=0.01))


def test_val_path_and_its_own_keys(tmp_path):
    from hybrid_rl.data.prompts import load_datasets

    train, val = tmp_path / "t.jsonl", tmp_path / "v.jsonl"
    train.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n")
    val.write_text(json.dumps({"prompt": "b", "answer": "2"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    ds = load_datasets(_data(task="jsonl", path=str(train), val_path=str(val)))
    assert [r["prompt"] for r in ds.val] == ["b", "c"] and ds.val_source == str(val)
    with pytest.raises(ValueError, match=r"v\.jsonl: row 1 has no 'answer'"):
        load_datasets(_data(task="jsonl", path=str(train), val_path=str(val), answer_key="answer"))


def test_conversational_rows_with_nested_answer_key(tmp_path):
    """verl's parquet rows / TRL's conversational format: the prompt is a list of chat messages and the
    answer sits in a nested field. The instruction joins the last user turn, which is also the row's text."""
    from hybrid_rl.data.prompts import load_datasets

    rows = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i} + 1?"}],
            "reward_model": {"ground_truth": str(i + 1)},
            "data_source": "toy",
        }
        for i in range(3)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_datasets(_data(task="jsonl", path=str(path), answer_key="reward_model.ground_truth", instruction="Go."))
    first = ds.train[0]
    assert first["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "0 + 1? Go."}]
    assert first["prompt"] == "0 + 1? Go." and [r["answer"] for r in ds.train] == ["1", "2", "3"]
    assert rows[0]["prompt"][1]["content"] == "0 + 1?", "the file's rows are not modified"
    bad = {
        "last turn is the assistant's": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "a role": [{"role": "robot", "content": "q"}],
        "neither a non-empty string nor": [],
        "string content": [{"role": "user", "content": ["q"]}],
    }
    for match, prompt in bad.items():
        path.write_text(json.dumps({"prompt": prompt}) + "\n")
        with pytest.raises(ValueError, match=match.replace("last turn is the assistant's", "'assistant' turn")):
            load_datasets(_data(task="jsonl", path=str(path)))
    path.write_text(json.dumps({"prompt": "q", "reward_model": {}}) + "\n")
    with pytest.raises(ValueError, match="no 'reward_model.ground_truth'"):
        load_datasets(_data(task="jsonl", path=str(path), answer_key="reward_model.ground_truth"))


def test_prompt_encoder_renders_conversations_and_the_system_prompt(tmp_path):
    from hybrid_rl.data.chat import PromptEncoder
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir

    tok = load_tokenizer(build_tiny_text_model_dir(str(tmp_path / "m")))
    enc = PromptEncoder(tok, True, "m", system_prompt="S")
    chat = {"prompt": "q", "messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]}
    text = {"prompt": "q"}
    head = "<|im_start|>assistant\n"
    assert tok.decode(enc(chat)) == "<|im_start|>system\nown<|im_end|>\n<|im_start|>user\nq<|im_end|>\n" + head
    assert tok.decode(enc(text)) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n" + head
    # Same last user turn, other conversation: encoded apart, not served from the text prompt's cache.
    assert enc.encode_all([text, chat], "rows") == [len(enc(text)), len(enc(chat))] and enc(text) != enc(chat)
    with pytest.raises(ValueError, match="data.chat_template=false: messages need"):
        PromptEncoder(tok, False).encode_all([chat], "rows")
    with pytest.raises(ValueError, match="data.system_prompt"):
        PromptEncoder(tok, False, system_prompt="S")


def test_parquet_needs_pyarrow_or_reads_the_rows(tmp_path):
    from hybrid_rl.data.rows import read_rows

    path = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            read_rows(str(path))
        return
    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "answer": "1"}]), str(path))
    assert read_rows(str(path)) == [{"prompt": "x", "answer": "1"}]


def test_prompt_encoder_renders_the_chat_template_once_per_prompt_and_drops_long_prompts(tmp_path):
    from hybrid_rl.data.chat import PromptEncoder, drop_long_prompts, use_chat_template
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir

    tok = load_tokenizer(build_tiny_text_model_dir(str(tmp_path / "m")))
    assert use_chat_template(tok, None, "m") is True and use_chat_template(tok, False, "m") is False
    enc = PromptEncoder(tok, True, "m")
    rows = [{"prompt": "hi"}, {"prompt": "a much longer prompt"}, {"prompt": "hi"}]
    lengths = enc.encode_all(rows, "rows")
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert enc("hi") == tok(text, add_special_tokens=False).input_ids and lengths[0] == lengths[2] == len(enc("hi"))
    assert tok.decode(enc("hi")) == text
    kept, dropped = drop_long_prompts(rows, lengths, lengths[0])
    assert kept == [rows[0], rows[2]] and dropped == 1
    assert drop_long_prompts(rows, lengths, 0) == (rows, 0)
    raw = PromptEncoder(tok, False)
    assert raw("hi") == tok("hi", add_special_tokens=False).input_ids


def test_text_tokenizer_round_trips_gsm8k_and_has_one_token_for_the_marker(tmp_path):
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir
    from tests.data_helpers import gsm8k_dir

    tok = load_tokenizer(build_tiny_text_model_dir(str(tmp_path / "m")))
    with open(os.path.join(gsm8k_dir(), "test.jsonl")) as f:
        texts = [(lambda r: r["question"] + "\n" + r["answer"])(json.loads(next(f))) for _ in range(50)]
    for t in texts:
        assert tok.decode(tok(t, add_special_tokens=False).input_ids) == t  # unicode included (GSM8K has some)
    assert tok.convert_ids_to_tokens(tok("####", add_special_tokens=False).input_ids) == ["####"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.chat_template
