"""The math-answer verifier and the `gsm8k` reward, on hand-written cases (adversarial ones included).

Each row of CASES is (completion, reference answer, finish_reason, strict, flexible): the
reward each mode must give with format_score=0. The reference is written the way a dataset
writes it (a GSM8K solution ending in `#### n`, or a bare number).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from hybrid_rl.rewards.base import compute_rewards, get_reward
from hybrid_rl.rewards.math import (
    check_math_rows,
    extract_answer,
    gsm8k_format_reward,
    gsm8k_reward,
    parse_number,
    reference_answer,
    score_answer,
)

SOLUTION_18 = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
)

CASES = [
    # -- plain and equivalent forms of the right answer
    ("#### 18", "18", "stop", 1.0, 1.0),
    ("9 * 2 = 18 dollars.\n#### 18", SOLUTION_18, "stop", 1.0, 1.0),
    ("#### 18.0", "18", "stop", 1.0, 1.0),
    ("#### 18.00", "18", "stop", 1.0, 1.0),
    ("####18", "18", "stop", 1.0, 1.0),  # no space after the marker
    ("#### $18", "18", "stop", 1.0, 1.0),
    ("#### 18 dollars.", "18", "stop", 1.0, 1.0),  # units and trailing punctuation
    ("#### 18.", "18", "stop", 1.0, 1.0),
    # -- thousands separators, either side
    ("#### 1,800", "1800", "stop", 1.0, 1.0),
    ("#### 1800", "#### 1,800", "stop", 1.0, 1.0),
    ("#### $1,800.00", "1800", "stop", 1.0, 1.0),
    ("#### 1,800", "180", "stop", 0.0, 0.0),  # the separator is not a decimal point
    ("The total is 109,200,000 cents.", "109200000", "stop", 0.0, 1.0),
    # -- several markers: the last one counts
    ("#### 12\nwait, I made an error.\n#### 18", "18", "stop", 1.0, 1.0),
    ("#### 18\nwait, I made an error.\n#### 12", "18", "stop", 0.0, 0.0),
    ("#### 18\n####", "18", "stop", 0.0, 1.0),  # the last marker has no number: strict finds no answer
    # -- negative numbers, decimals, fractions
    ("#### -5", "-5", "stop", 1.0, 1.0),
    ("#### 5", "-5", "stop", 0.0, 0.0),
    ("#### \u22125", "-5", "stop", 1.0, 1.0),  # the unicode minus sign
    ("#### -$5", "-5", "stop", 1.0, 1.0),
    ("It is 8-3 = 5", "5", "stop", 0.0, 1.0),  # a subtraction, not a -3
    ("#### 0.5", "0.5", "stop", 1.0, 1.0),
    ("#### .5", "0.5", "stop", 1.0, 1.0),
    ("#### 1/2", "0.5", "stop", 1.0, 1.0),
    ("#### 3/4", "0.75", "stop", 1.0, 1.0),
    ("#### 0.33", "1/3", "stop", 0.0, 0.0),  # exact comparison: no tolerance
    ("#### 18.5", "18", "stop", 0.0, 0.0),
    # -- an answer only mid-text, or none at all
    ("So she makes 18 dollars every day at the market", "18", "stop", 0.0, 1.0),
    ("18 eggs, then 2 more", "18", "stop", 0.0, 0.0),  # flexible takes the LAST number
    ("#### the answer is 18", "18", "stop", 0.0, 1.0),  # strict: the number must follow the marker
    ("", "18", "stop", 0.0, 0.0),
    ("####", "18", "stop", 0.0, 0.0),
    ("no numbers here", "18", "stop", 0.0, 0.0),
    ("#### 180", "18", "stop", 0.0, 0.0),
    # -- completions cut at max_new_tokens
    ("She makes 9 * 2 = $1", "18", "length", 0.0, 0.0),
    ("#### 1", "18", "length", 0.0, 0.0),  # cut from "#### 18"
    ("#### 18", "18", "length", 0.0, 0.0),  # may have been "#### 180": the cut touches the number
    ("#### 18.", "18", "length", 0.0, 0.0),  # may have been "#### 18.5"
    ("#### 18\nThat is the answer and", "18", "length", 1.0, 1.0),  # a complete answer, the rambling cut later
    ("#### 18\nor maybe 2", "18", "length", 1.0, 0.0),  # flexible: the last number is 2
    ("#### 18\nThat is all", "18", "stop", 1.0, 1.0),
]


@pytest.mark.parametrize("completion,reference,finish,strict,flexible", CASES)
def test_gsm8k_reward_hand_cases(completion, reference, finish, strict, flexible):
    meta = [{"answer": reference, "finish_reason": finish, "response_tokens": len(completion)}]
    assert gsm8k_reward(["q"], [completion], meta, mode="strict") == [strict]
    assert gsm8k_reward(["q"], [completion], meta, mode="flexible") == [flexible]


@pytest.mark.parametrize(
    "completion,reference,finish,expected",
    [
        ("#### 17", "18", "stop", 0.1),  # an answer in the right form, wrong: the format score
        ("#### 18", "18", "stop", 1.0),
        ("the answer is 18", "18", "stop", 0.0),  # strict: no answer at all
        ("#### 1", "18", "length", 0.0),  # cut: not even the format counts
    ],
)
def test_format_score(completion, reference, finish, expected):
    meta = [{"answer": reference, "finish_reason": finish, "response_tokens": 3}]
    assert gsm8k_reward(["q"], [completion], meta, format_score=0.1) == [expected]


def test_ground_truth_key_wins_over_answer():
    meta = {"answer": "#### 99", "ground_truth": "1,200", "finish_reason": "stop", "response_tokens": 1}
    assert gsm8k_reward(["q"], ["#### 1200"], [meta]) == [1.0]


@pytest.mark.parametrize(
    "token,value",
    [
        ("18", 18),
        ("18.00", 18),
        ("1,800", 1800),
        ("-3", -3),
        ("3/4", Fraction(3, 4)),
        ("1 / 2", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("1/0", None),
    ],
)
def test_parse_number(token, value):
    assert parse_number(token) == (Fraction(value) if value is not None else None)


@pytest.mark.parametrize(
    "answer,value",
    [
        (SOLUTION_18, 18),
        ("1,200", 1200),
        ("$5", 5),
        ("-7", -7),
        ("0.25.", 0.25),
        ("eighteen", None),
        ("18 apples", None),
        ("#### ", None),
    ],
)
def test_reference_answer(answer, value):
    assert reference_answer(answer) == (Fraction(str(value)) if value is not None else None)


def test_extract_answer_reports_where_the_number_ends():
    assert extract_answer("x #### 18 dollars", "strict") == (Fraction(18), 9)
    assert extract_answer("a 3 b 4 c", "flexible") == (Fraction(4), 7)
    with pytest.raises(ValueError, match="mode"):
        extract_answer("#### 1", "loose")


def test_score_answer_defaults_are_strict():
    assert score_answer("it is 18", Fraction(18)) == 0.0
    assert score_answer("it is 18", Fraction(18), mode="flexible") == 1.0


def test_the_registered_reward_is_the_function_and_checks_rows():
    spec = get_reward("gsm8k")
    assert spec.fn is gsm8k_reward and spec.success_threshold == 1.0 and spec.check_rows is check_math_rows
    meta = [{"answer": SOLUTION_18, "finish_reason": "stop", "response_tokens": 2}] * 3
    got = compute_rewards("gsm8k", spec, ["q"] * 3, ["#### 18", "#### 19", ""], meta)
    assert got == [1.0, 0.0, 0.0]


def test_check_math_rows_names_the_bad_row():
    check_math_rows([{"answer": SOLUTION_18}, {"answer": "1,200"}, {"ground_truth": "5"}], "f.jsonl")
    with pytest.raises(ValueError, match=r"f\.jsonl: row 1: answer 'about five' has no final number"):
        check_math_rows([{"answer": "#### 5"}, {"answer": "about five"}], "f.jsonl")
    with pytest.raises(ValueError, match=r"f\.jsonl: row 0 has no 'answer'.*data\.answer_key"):
        check_math_rows([{"question": "q"}], "f.jsonl")


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="reward.kwargs.mode"):
        gsm8k_reward(["q"], ["#### 1"], [{"answer": "1", "finish_reason": "stop"}], mode="lenient")


@pytest.mark.parametrize(
    "completion,finish,expected",
    [
        ("#### 42", "stop", 1.0),
        ("so #### 7 is it", "stop", 1.0),
        ("#### 4 #### 5", "stop", 1.0),
        ("#### seven, or 7", "stop", 0.5),  # marker and number in order, not together
        ("#### x 7 ####", "stop", 0.5),  # the last marker has no number after it
        ("####", "stop", 0.0),
        ("################", "length", 0.0),  # a bare (or repeated) marker earns nothing
        ("7 ####", "stop", 0.0),
        ("42", "stop", 0.0),
        ("", "stop", 0.0),
        ("#### 4", "length", 0.0),
        ("#### a 4", "length", 0.0),  # numbers the cut may have shortened
        ("#### 4\nmore", "length", 1.0),
        ("#### a 4 b", "length", 0.5),
    ],
)
def test_gsm8k_format_reward(completion, finish, expected):
    assert gsm8k_format_reward(["q"], [completion], [{"answer": "1", "finish_reason": finish}]) == [expected]


@pytest.mark.parametrize(
    "completion,verl,ours",
    [
        ("so #### 18", 1.0, 1.0),
        ("#### 18.", 0.5, 1.0),  # verl compares text: '18.' is a wrong answer, not a missing one
        ("#### 18.00", 0.5, 1.0),
        ("####18", 0.0, 1.0),  # verl needs exactly one space after ####
        ("#### $18", 0.0, 1.0),
        ("#### 1,800 apples", 0.5, 0.5),  # commas dropped on both sides: 1800 != 18
        ("#### 17 no, #### 18", 1.0, 1.0),  # the last match
        ("#### 18\n\n####", 1.0, 0.0),  # ours reads after the LAST ####, where there is no number
        ("#### -18", 0.5, 0.5),
        ("no answer 18", 0.0, 0.0),
    ],
)
def test_verl_mode_reproduces_verls_text_match(completion, verl, ours):
    """mode=verl scores as verl's gsm8k compute_score(method=strict) does (read from verl's source:
    findall('#### (\\-?[0-9\\.\\,]+)'), last match, commas removed, string equality), format_score 0.5."""
    meta = [{"answer": "Natalia sold 18 clips.\n#### 18", "finish_reason": "stop"}]
    assert gsm8k_reward(["q"], [completion], meta, mode="verl", format_score=0.5) == [verl]
    assert gsm8k_reward(["q"], [completion], meta, mode="strict", format_score=0.5) == [ours]
    comma = [{"answer": "#### 1,800", "finish_reason": "stop"}]
    assert gsm8k_reward(["q"], ["#### 1,800"], comma, mode="verl") == [1.0]
    assert gsm8k_reward(["q"], ["#### 1800"], comma, mode="verl") == [1.0]
