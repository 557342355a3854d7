"""envs/calculator.py, envs/tools.py, envs/gsm8k_calc.py: arithmetic without eval, tool calls that cannot crash.

The calculator takes text a policy wrote, so it is fed code-injection attempts: every one must be
refused with an error (never run, never hang), and through the tool environment that error is an
observation for the model and a counted tool error, not an exception.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from hybrid_rl.envs.calculator import CalculatorError, calculator, evaluate
from hybrid_rl.envs.gsm8k_calc import GSM8KCalculatorEnv, gsm8k_calculator
from hybrid_rl.envs.tools import ToolEnv, parse_tool_calls, tool_schema


@pytest.mark.parametrize(
    "expression, value",
    [
        ("(12 + 3) * 4 / 5", "12"),
        ("0.1 + 0.2", "0.3"),
        ("7 / 3", "2.333333333"),
        ("2^10", "1024"),
        ("2 ** -3", "0.125"),
        ("-2 ** 2", "-4"),
        ("1,200 * 3", "3600"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("3 \u00d7 4 \u00f7 6", "2"),
        ("10**59", "1" + "0" * 59),
        ("(-1) ** (10**20)", "1"),
    ],
)
def test_calculator_arithmetic(expression, value):
    assert calculator(expression) == value


INJECTIONS = [
    "__import__('os').system('echo pwned')",
    "().__class__.__bases__[0].__subclasses__()",
    "lambda: 1",
    "open('/etc/passwd').read()",
    "[x for x in range(10**9)]",
    "'a' * 10",
    "x",
    "abs(-1)",
    "(1).real",
    "globals()",
    "exec('1')",
    "1 if 1 else 2",
    "1 < 2",
    "{1: 2}",
    "b'1'",
    "1j * 2",
    "True + 1",
    "9 ** 9 ** 9",
    "10 ** 61",
    "2 ** 1000",
    "(10**40) * (10**40)",
    "1 / 0",
    "2 ** 0.5",
    "1 << 100",
    "(" * 200 + "1" + ")" * 200,
    "1" * 300,
    "1e400",
    "",
    "a := 1",
    "__builtins__",
]


@pytest.mark.timeout(60)  # a hang detector: an unbounded 9 ** 9 ** 9 would run for many minutes, a refusal takes ms
@pytest.mark.parametrize("attempt", INJECTIONS)
def test_calculator_refuses_everything_but_bounded_arithmetic(attempt):
    with pytest.raises(CalculatorError):
        evaluate(attempt)


def test_refusal_names_the_node():
    with pytest.raises(CalculatorError, match="Call is not allowed"):
        evaluate("__import__('os')")
    with pytest.raises(CalculatorError, match="Attribute is not allowed"):
        evaluate("(1).real")


def test_exact_fractions():
    assert evaluate("1/3 + 1/3 + 1/3") == Fraction(1)


def _weather(city: str, days: int = 1) -> dict:
    """Look up the weather.

    Args:
        city: The city's name.
        days (int): How many days ahead,
            counting today.
    Returns:
        A forecast.
    """
    if city == "nowhere":
        raise LookupError("no such city")
    return {"city": city, "days": days}


def test_schema_from_signature_and_docstring():
    s = tool_schema(_weather)["function"]
    assert s["name"] == "_weather" and s["description"] == "Look up the weather."
    assert s["parameters"]["properties"] == {
        "city": {"type": "string", "description": "The city's name."},
        "days": {"type": "integer", "description": "How many days ahead, counting today."},
    }
    assert s["parameters"]["required"] == ["city"]
    calc = tool_schema(calculator)["function"]
    assert (
        calc["parameters"]["required"] == ["expression"]
        and "Numbers with" in calc["parameters"]["properties"]["expression"]["description"]
    )


def test_tool_without_docstring_is_refused():
    def bare(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="no docstring"):
        tool_schema(bare)


def test_parse_tool_calls_in_qwen25_format():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "c", '
        '"arguments": 3}</tool_call><tool_call>{"name": "cut'
    )
    calls, problems = parse_tool_calls(text)
    assert calls == [("calculator", {"expression": "2+2"}), ("calculator", {"expression": "1"})]
    assert len(problems) == 4 and "not valid JSON" in problems[0] and "not closed" in problems[-1]


def _call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_tool_env_turns_every_failure_into_a_counted_observation():
    env = ToolEnv([calculator, _weather])
    turn = (
        _call("calculator", expression="6*7")
        + _call("calculator", expression="__import__('os')")
        + _call("_weather", city="nowhere")
        + _call("nope")
        + _call("_weather", town="x")
        + "<tool_call>oops</tool_call>"
    )
    step = env.step(turn)
    contents = [m["content"] for m in step.observation]
    assert all(m["role"] == "tool" for m in step.observation) and not step.done and step.reward == 0.0
    assert contents[0].startswith("error: the tool call is not valid JSON")  # malformed first, then calls in order
    assert contents[1] == "42"
    assert "CalculatorError" in contents[2] and "Call is not allowed" in contents[2]
    assert "LookupError: no such city" in contents[3]
    assert "unknown tool 'nope'" in contents[4] and "bad arguments for '_weather'" in contents[5]
    assert env.metrics() == {"tool_calls": 3, "malformed_calls": 3, "tool_errors": 2}
    final = env.step("no tool call here")
    assert final.done and final.observation == []


def test_tool_env_caps_calls_per_turn():
    env = ToolEnv([calculator], max_calls_per_turn=2)
    step = env.step(_call("calculator", expression="1") * 3)
    assert [m["content"] for m in step.observation][:2] == ["1", "1"] and "at most 2" in step.observation[2]["content"]
    assert env.metrics()["tool_calls"] == 2 and env.metrics()["malformed_calls"] == 1


def test_tool_list_reaches_the_model_in_the_system_turn():
    messages = ToolEnv([calculator]).reset({"prompt": "q"})
    assert messages[0]["role"] == "system" and '"name": "calculator"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"] and messages[1] == {"role": "user", "content": "q"}


ROW = {"question": "q", "answer": "... #### 42", "prompt": "q Let's think", "ground_truth": "42"}


@pytest.mark.parametrize("answer, reward", [("so #### 42", 1.0), ("#### 41", 0.0), ("42", 0.0)])
def test_gsm8k_calculator_final_answer_scored_by_the_gsm8k_rule(answer, reward):
    env = gsm8k_calculator(ROW)
    assert isinstance(env, GSM8KCalculatorEnv)
    env.reset(ROW)
    tool_step = env.step(_call("calculator", expression="6*7"))
    assert tool_step.observation == [{"role": "tool", "content": "42"}] and not tool_step.done
    final = env.step(answer)
    assert final.done and final.reward == reward  # strict mode: the number after `####`
    assert env.metrics()["tool_calls"] == 1
