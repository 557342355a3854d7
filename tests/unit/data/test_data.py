"""Prompt data at `Trainer(cfg)`: JSONL files, GSM8K directories, validation sets, chat templates and
prompt lengths. Bad data fails before a training step with an error that names the file, the row and
the key to fix. (The loader, row formats and splits that work are in test_data_rewards.py.)

Where the check can run before the model is loaded, `no_model_build` (tests/conftest.py) makes
loading the model an assertion failure, so the test also pins *when* the error comes.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hybrid_rl.config.load import load_config
from hybrid_rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _trainer(overrides, *extra):
    return Trainer(load_config(None, [*overrides, *extra]))


def _copy_model_dir(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------------------- JSONL files
def test_jsonl_row_without_prompt(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: a row without the prompt key skipped, or reported without its row number, the
    row itself, the file and data.prompt_key."""
    path = tmp_path / "data.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "1 2 3 =", "answer": "234"},
                {"prompt": "4 5 6 =", "answer": "567"},
                {"question": "7 8 9 =", "answer": "890"},  # row 2: wrong key
                {"prompt": "0 0 0 =", "answer": "111"},
            ]
        )
        + "\n"
    )
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}")
    msg = str(err.value)
    assert "row 2" in msg and "'prompt'" in msg and "data.prompt_key" in msg and str(path) in msg
    assert "7 8 9 =" in msg  # shows the offending row


@pytest.mark.parametrize("row", [{"prompt": ""}, {"prompt": "   "}, {"prompt": 3}, {"prompt": None}, ["a list"]])
def test_jsonl_row_with_unusable_prompt(tmp_path, row):
    """Catches: load_rows accepting an empty, blank or non-string prompt, or a row that is not an object."""
    from hybrid_rl.data.prompts import load_rows

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="row 1"):
        load_rows("jsonl", str(path))


def test_jsonl_bad_json_names_the_line(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: the JSON decoder's error passed through without the file and line number."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1 ="}\n{"prompt": "2 =", \n')
    with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}")


def test_jsonl_missing_or_empty_file(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: a missing file reported without data.path, or a file of blank lines accepted as a
    dataset with no rows."""
    with pytest.raises(FileNotFoundError, match="data.path"):
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={tmp_path / 'nope.jsonl'}")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no rows"):
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={empty}")


def test_dataset_smaller_than_batch(tiny_trainer_overrides):
    """Catches: a dataset with fewer prompts than one step's batch accepted."""
    with pytest.raises(ValueError, match="fewer than data.batch_size=4"):
        _trainer(tiny_trainer_overrides, "data.num_prompts=3")


def test_jsonl_row_without_the_answer_key(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: data.answer_key checked on the first row only (row 1 lacks it), so the reward
    would fail on it mid-run."""
    path = _write_rows(tmp_path / "d.jsonl", [{"q": "1 2 3 =", "a": "234"}, {"q": "4 5 6 ="}])
    with pytest.raises(ValueError) as err:
        _trainer(
            tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}", "data.prompt_key=q", "data.answer_key=a"
        )
    assert "row 1" in str(err.value) and "'a'" in str(err.value) and "data.answer_key" in str(err.value)


# ---------------------------------------------------------------------------- GSM8K and math answers
def _gsm8k_dir(tmp_path, train_rows, test_rows=None):
    d = tmp_path / "gsm8k"
    d.mkdir()
    _write_rows(d / "train.jsonl", train_rows)
    if test_rows is not None:
        _write_rows(d / "test.jsonl", test_rows)
    return str(d)


GOOD = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(6)]


def test_gsm8k_directory_without_a_train_file(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: a GSM8K directory without train.jsonl reported without data.path, the file it looked
    for and the directory."""
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        _trainer(tiny_trainer_overrides, "data.task=gsm8k", f"data.path={tmp_path / 'empty_dir'}", "reward.name=gsm8k")
    assert "data.path" in str(err.value) and "train.jsonl" in str(err.value) and "empty_dir" in str(err.value)


@pytest.mark.parametrize(
    "bad,words",
    [
        ({"question": "How many?", "answer": "Two and two make four."}, ["row 3", "#### <number>", "four"]),
        ({"query": "How many?", "answer": "#### 4"}, ["row 3", "'question'"]),
        ({"question": "How many?", "answer": 4}, ["row 3", "'answer'"]),
    ],
)
def test_gsm8k_rows_without_question_or_final_answer(tiny_trainer_overrides, tmp_path, no_model_build, bad, words):
    """Catches: a GSM8K row without a question, or without a '#### <number>' final answer, accepted
    (the reward would score every sample of it 0) or reported without the file and row."""
    d = _gsm8k_dir(tmp_path, GOOD[:3] + [bad] + GOOD[3:], GOOD)
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "data.task=gsm8k", f"data.path={d}", "reward.name=gsm8k")
    msg = str(err.value)
    assert os.path.join(d, "train.jsonl") in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_math_reward_rejects_an_answer_without_a_number(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: reward.name=gsm8k accepting a JSONL row whose reference answer holds no number (every
    sample of it would score 0), or reporting it without the file and row."""
    rows = [{"q": f"{i} =", "a": f"#### {i}"} for i in range(4)] + [{"q": "x =", "a": "about five"}]
    path = _write_rows(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError) as err:
        _trainer(
            tiny_trainer_overrides,
            "data.task=jsonl",
            f"data.path={path}",
            "data.prompt_key=q",
            "data.answer_key=a",
            "reward.name=gsm8k",
        )
    assert f"{path}: row 4" in str(err.value) and "about five" in str(err.value)


# ---------------------------------------------------------------------------- validation sets
def test_val_path_missing(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: data.val_path not checked at start-up (the run would fail at its first validation)."""
    path = _write_rows(tmp_path / "d.jsonl", [{"prompt": f"{i} 1 2 ="} for i in range(8)])
    with pytest.raises(FileNotFoundError, match="data.val_path"):
        _trainer(
            tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}", f"data.val_path={tmp_path / 'v.jsonl'}"
        )


def test_validation_set_smaller_than_its_batch(tiny_trainer_overrides, no_model_build):
    """Catches: a validation split with fewer prompts than data.val_batch_size accepted."""
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "data.num_prompts=30", "data.val_split=0.1", "trainer.val_every=1")
    msg = str(err.value)
    assert "3 prompts, fewer than its batch of 4" in msg and "data.val_batch_size" in msg


def test_validation_without_a_validation_set(tiny_trainer_overrides, no_model_build):
    """Catches: trainer.val_every set without a validation set accepted (validation would never run)."""
    with pytest.raises(ValueError, match="'trainer.val_every'.*data.val_path or data.val_split"):
        _trainer(tiny_trainer_overrides, "trainer.val_every=5")


# ---------------------------------------------------------------------------- chat templates, prompt lengths
@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir

    return build_tiny_text_model_dir(str(tmp_path_factory.mktemp("tiny_text") / "model"))


def test_chat_template_that_fails(text_model_dir, tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: a chat template that raises reported without the model directory, the row, the
    template's own message and the data.chat_template=false way out."""
    d = _copy_model_dir(text_model_dir, tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text("{{ raise_exception('no user turns here') }}")
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, f"model.path={d}")
    msg = str(err.value)
    assert "chat template" in msg and d in msg and "row 0" in msg and "no user turns here" in msg
    assert "data.chat_template=false" in msg


def test_chat_template_required_but_absent(tiny_trainer_overrides, no_model_build):
    """Catches: data.chat_template=true on a tokenizer without a template falling back to plain text."""
    with pytest.raises(ValueError, match="'data.chat_template'.*has no chat template"):
        _trainer(tiny_trainer_overrides, "data.chat_template=true")


def test_every_prompt_longer_than_the_limit(tiny_trainer_overrides, no_model_build):
    """Catches: data.max_prompt_tokens dropping every prompt without an error (no rows left to train on)."""
    with pytest.raises(ValueError, match=r"every train prompt .* longer than data.max_prompt_tokens=2 .*4 tokens"):
        _trainer(tiny_trainer_overrides, "data.max_prompt_tokens=2")


def _short_context_model(src, dst, positions):
    d = _copy_model_dir(src, dst)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = positions
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return d


def test_prompts_that_leave_no_room_for_the_answer_in_the_context(
    tiny_model_dir, tiny_trainer_overrides, tmp_path, no_model_build
):
    """A prompt plus rollout.max_new_tokens must fit the model's context (SGLang rejects the whole
    batch otherwise): the digits prompts have 4 tokens, so a context of 8 with 4 new tokens keeps
    prompts of at most 8 - 4 - 1 = 3 tokens, none of them.

    Catches: prompt lengths checked against data.max_prompt_tokens only, not the model's context
    less rollout.max_new_tokens, and rollout.max_new_tokens >= the context accepted."""
    d = _short_context_model(tiny_model_dir, tmp_path / "model", 8)
    with pytest.raises(
        ValueError,
        match=r"every train prompt .* longer than 3 tokens \(the model's context of 8 less "
        r"rollout.max_new_tokens=4 and one\) \(the shortest has 4 tokens\).*lower "
        r"rollout.max_new_tokens",
    ):
        _trainer(tiny_trainer_overrides, f"model.path={d}", "rollout.max_new_tokens=4")
    with pytest.raises(
        ValueError,
        match=r"rollout.max_new_tokens=7 leaves no room for a prompt in the model's "
        r"context of 8 tokens",
    ):
        _trainer(tiny_trainer_overrides, f"model.path={d}", "rollout.max_new_tokens=7")
