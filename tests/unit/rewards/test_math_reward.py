"""rewards/latex_math.py: the `math` reward, LaTeX answers verified by math-verify.

Hand cases where text comparison fails and symbolic comparison holds (a fraction against a
decimal, a factored polynomial, an interval), the truncation rule, the registry entry and its row
check, and a call from a non-main thread (an environment's step thread), where math-verify's
SIGALRM timeout cannot be set.
"""

from __future__ import annotations

import threading

import pytest

from hybrid_rl.rewards.base import get_reward
from hybrid_rl.rewards.latex_math import check_latex_rows, math_reward
from hybrid_rl.rewards.math import gsm8k_reward


def _score(completion, answer, finish="stop", key="answer"):
    return math_reward([""], [completion], [{key: answer, "finish_reason": finish}])[0]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"so $\boxed{\frac{1}{2}}$", "0.5", 1.0),
        (r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),
        (r"$x^2+2x+1$", "(x+1)^2", 1.0),
        (r"$\boxed{[0, 1)}$", "[0,1)", 1.0),
        (r"$\boxed{2}$", "3", 0.0),
        (r"$\boxed{[0, 1]}$", "[0,1)", 0.0),
        ("no idea", "1", 0.0),
        (r"first $\boxed{3}$ then I recheck: $\boxed{4}$", "4", 1.0),
    ],
)
def test_symbolic_match(completion, answer, expected):
    assert _score(completion, answer) == expected


def test_reference_from_a_math_solution_or_ground_truth():
    assert _score(r"$\boxed{6}$", r"so the total is $\boxed{6}$.", key="solution") == 1.0
    row = {"ground_truth": "6", "answer": "7", "finish_reason": "stop"}
    assert math_reward([""], [r"$\boxed{6}$"], [row]) == [1.0]


def test_truncated_completion_counts_only_a_closed_box():
    assert _score(r"it is $\boxed{12}$", "12", finish="length") == 1.0
    assert _score("it is 12", "12", finish="length") == 0.0  # may have been 125 before the cut
    assert _score("it is 12", "12", finish="stop") == 1.0


def test_registered_as_math_with_a_row_check():
    spec = get_reward("math")
    assert spec.fn is math_reward and spec.check_rows is check_latex_rows
    check_latex_rows([{"answer": r"\frac{1}{2}"}], "rows")
    with pytest.raises(ValueError, match=r"rows: row 1: the row has none of"):
        check_latex_rows([{"answer": "1"}, {"question": "q"}], "rows")


def test_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(_score(r"$\boxed{3}$", "3")))
    t.start()
    t.join(60)
    assert out == [1.0]


def test_gsm8k_strict_mode_is_unchanged():
    assert gsm8k_reward([""], ["#### 18"], [{"answer": "#### 18", "finish_reason": "stop"}]) == [1.0]
    assert gsm8k_reward([""], [r"$\boxed{18}$"], [{"answer": "#### 18", "finish_reason": "stop"}]) == [0.0]
