"""Prompts a tokenizer cannot encode (data/chat.py `PromptEncoder`): refused before training, naming the file,
the row and the text, instead of training on a prompt with words silently dropped.

Catches: the tiny digits model's tokenizer dropping `hello` from `hello 1 2 =` unnoticed, a prompt that encodes
to nothing failing later without its row, and a false refusal of text a byte-level tokenizer does encode
(unicode, a chat template's special tokens, another Unicode form of the same text).
"""

from __future__ import annotations

import json

import pytest

from hybrid_rl.data.chat import PromptEncoder
from hybrid_rl.data.rows import DataError


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir

    return build_tiny_text_model_dir(str(tmp_path_factory.mktemp("text") / "model"))


@pytest.mark.parametrize(
    "prompt, says",
    [
        ("hello 1 2 =", "its vocabulary has no token for 'hello'"),
        ("1 + 2 =", "its vocabulary has no token for '+'"),
        ("\uff11 2 =", "its vocabulary has no token for '\uff11'"),  # a full-width digit
        ("   ", "it encodes to no token at all"),
    ],
)
def test_the_digits_tokenizer_refuses_text_it_has_no_word_for(tiny_tokenizer, tiny_model_dir, prompt, says):
    enc = PromptEncoder(tiny_tokenizer, False, tiny_model_dir)
    rows = [{"prompt": "1 2 3 ="}, {"prompt": prompt}]
    with pytest.raises(DataError) as err:
        enc.encode_all(rows, "data/rows.jsonl")
    msg = str(err.value)
    assert msg.startswith("the prompt of data/rows.jsonl row 1 cannot be encoded by the tokenizer of ") and says in msg
    assert "the tiny digits model knows only the digits 0-9 and '='" in msg and "\n" not in msg


def test_what_a_tokenizer_encodes_is_not_refused(tiny_tokenizer, tiny_model_dir, text_model):
    from hybrid_rl.models.loading import load_tokenizer

    assert PromptEncoder(tiny_tokenizer, False, tiny_model_dir).encode_all([{"prompt": "1 2 3 ="}], "digits") == [4]
    text = load_tokenizer(text_model)
    rows = [
        {"prompt": "Natalia sold clips to 48 friends -- 12% more than in April. How many? ####"},
        {"prompt": "Caf\u00e9 ol\u00e9: \u4e2d\u6587, emoji \U0001f600, and e\u0301 decomposed"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]},
    ]
    lengths = PromptEncoder(text, True, text_model, "You are helpful.").encode_all(rows, "mixed")
    assert all(n > 5 for n in lengths)


def test_the_trainer_refuses_the_row_before_the_model_loads(tiny_trainer_overrides, tmp_path, no_model_build):
    from hybrid_rl import Trainer, load_config

    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{d} {d} {d} =", "answer": "111"} for d in range(7)] + [
        {"prompt": "what is 1 =", "answer": "1"}
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [*tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}", "data.answer_key=answer"])
    with pytest.raises(ValueError, match=rf"the prompt of {path} row 7 cannot be .*no token for 'what is'"):
        Trainer(cfg)
