"""envs/calculator.py against independent evaluators: `^` is a power with the precedence of `**`.

Random expressions over the accepted grammar (integers, decimals, + - * / // % ** ^, unary signs,
parentheses, nesting) are evaluated by the tool and by `_reference`, a small recursive-descent
evaluator over exact fractions written here from Python's grammar, which also applies the refusals
the tool promises; the two must agree on every expression, refusals included. Where the reference
accepts, sympy's own parser (its `convert_xor` transformation reads `^` as `**`, `rationalize` keeps
decimals exact) must give the same value, so a precedence mistake shared by the tool and the
reference would still show. sympy's `%` follows Python's floor rule on rationals, but sympy 1.14 gets
`Rational // Integer` wrong (Integer.__rfloordiv__ truncates the left operand: 0.4 // -3 gives 0, not -1),
so sympy is asked only about expressions without `//`; the reference covers `//`.
"""

from __future__ import annotations

import inspect
import math
import random
import re
from collections import Counter
from fractions import Fraction
from functools import lru_cache

import pytest

from hybrid_rl.envs.calculator import MAX_CHARS, MAX_DEPTH, MAX_DIGITS, CalculatorError, calculator, evaluate
from hybrid_rl.envs.tools import tool_schema

# The refusals the tool promises (its docstring); the reference applies exactly these.
LIMIT = 10**60  # a numerator or denominator this large is refused, wherever it appears
DEPTH = 30  # operator nesting (unary and binary nodes; parentheses add none) beyond this is refused
CHARS = 200  # a longer expression is refused
# The tool's message -> the reason the reference gives.
REASONS = {
    "division by zero": "division by zero",
    "whole-number": "non-integer exponent",
    "too large": "too large",
    "deeper than": "too deep",
    "longer than": "too long",
}
CASES = 3000


def test_limits_are_the_ones_this_file_states():
    assert (10**MAX_DIGITS, MAX_DEPTH, MAX_CHARS) == (LIMIT, DEPTH, CHARS)


class Refused(Exception):
    """The reference refuses the expression; the message is one of REASONS' values."""


_TOKEN = re.compile(r"\s*(\d+\.\d*|\.\d+|\d+|\*\*|//|[-+*/%^()])")


def _reference(text: str) -> Fraction:
    """Parse with Python's expression grammar, restricted to what the generator writes, then evaluate.

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/" | "//" | "%") factor)*
    factor := ("+" | "-") factor | power
    power  := atom (("**" | "^") factor)?
    atom   := NUMBER | "(" expr ")"
    """
    if len(text.strip()) > CHARS:
        raise Refused("too long")
    tokens, at = [], 0
    while text[at:].strip():
        m = _TOKEN.match(text, at)
        assert m, f"the generator wrote something outside the grammar: {text!r}"
        tokens.append(m.group(1))
        at = m.end()
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expr():
        node = term()
        while peek() in ("+", "-"):
            node = (take(), node, term())
        return node

    def term():
        node = factor()
        while peek() in ("*", "/", "//", "%"):
            node = (take(), node, factor())
        return node

    def factor():
        if peek() in ("+", "-"):
            return ("unary" + take(), factor())
        node = atom()
        if peek() in ("**", "^"):
            take()
            node = ("**", node, factor())  # factor, not atom: right associative, and 2**-1 is allowed
        return node

    def atom():
        if peek() == "(":
            take()
            node = expr()
            assert take() == ")"
            return node
        return Fraction(take())  # Fraction reads "2.5" and ".5" exactly

    tree = expr()
    assert pos == len(tokens), text
    return _value(tree, 0)


def _value(node, depth: int) -> Fraction:
    if depth > DEPTH:
        raise Refused("too deep")
    if isinstance(node, Fraction):
        return _bounded(node)
    if node[0] in ("unary+", "unary-"):
        value = _value(node[1], depth + 1)
        return -value if node[0] == "unary-" else value
    op, a, b = node[0], _value(node[1], depth + 1), _value(node[2], depth + 1)
    if op == "**":
        return _power(a, b)
    if op in ("/", "//", "%") and b == 0:
        raise Refused("division by zero")
    if op == "+":
        return _bounded(a + b)
    if op == "-":
        return _bounded(a - b)
    if op == "*":
        return _bounded(a * b)
    if op == "/":
        return _bounded(a / b)
    if op == "//":
        return _bounded(Fraction(math.floor(a / b)))
    return _bounded(a - b * math.floor(a / b))  # Python's %: the remainder takes the divisor's sign


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise Refused("non-integer exponent")
    e = exponent.numerator
    size = max(abs(base.numerator), base.denominator)
    # size**|e| >= 2**201 > LIMIT; refused without computing it, as 9**9**9 must not be computed
    if size > 1 and abs(e) * (size.bit_length() - 1) > 200:
        raise Refused("too large")
    try:
        return _bounded(base**e)
    except ZeroDivisionError:
        raise Refused("division by zero") from None


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) >= LIMIT or value.denominator >= LIMIT:
        raise Refused("too large")
    return value


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:
        return str(rng.randint(0, 9))
    if kind < 0.75:
        return str(rng.randint(10, 2000))
    if kind < 0.95:
        return f"{rng.randint(0, 12)}.{rng.choice(('0', '5', '25', '1', '75', '05', '125'))}"
    return f".{rng.randint(1, 9)}"


def _expr(rng: random.Random, depth: int, small: bool = False) -> list[str]:
    out = _term(rng, depth, small)
    for _ in range(rng.choice((0, 0, 1))):
        out += [rng.choice(("+", "-"))] + _term(rng, depth, small)
    return out


def _term(rng: random.Random, depth: int, small: bool) -> list[str]:
    out = _factor(rng, depth, small)
    for _ in range(rng.choice((0, 0, 1))):
        out += [rng.choice(("*", "/", "//", "%"))] + _factor(rng, depth, small)
    return out


def _factor(rng: random.Random, depth: int, small: bool) -> list[str]:
    if rng.random() < 0.15:
        return [rng.choice(("+", "-"))] + _factor(rng, depth, small)
    out = _atom(rng, depth, small)
    if rng.random() < 0.3:
        # exponents mostly small whole numbers, or nearly every power would be refused
        out += [rng.choice(("**", "^", "^"))] + _factor(rng, depth, True)
    return out


def _atom(rng: random.Random, depth: int, small: bool) -> list[str]:
    if depth > 0 and rng.random() < 0.4:
        return ["("] + _expr(rng, depth - 1, small) + [")"]
    return [str(rng.randint(0, 3)) if small and rng.random() < 0.85 else _number(rng)]


@lru_cache(maxsize=1)
def _cases() -> list[str]:
    rng = random.Random(40)
    # the grammar never puts two tokens side by side that would merge ("*" "*", "/" "/"), so spaces are optional
    return ["".join(tok + rng.choice(("", "", " ")) for tok in _expr(rng, 3)).strip() for _ in range(CASES)]


def _outcome(fn, text: str):
    """A Fraction, or ("refused", reason)."""
    try:
        return fn(text)
    except Refused as err:
        return ("refused", str(err))
    except CalculatorError as err:
        reasons = [reason for key, reason in REASONS.items() if key in str(err)]
        return ("refused", reasons[0] if reasons else str(err))


def test_tool_agrees_with_the_reference_on_random_expressions():
    seen = Counter()
    for text in _cases():
        expected = _outcome(_reference, text)
        assert _outcome(evaluate, text) == expected, text
        seen["accepted" if isinstance(expected, Fraction) else expected[1]] += 1
        seen["accepted with ^"] += isinstance(expected, Fraction) and "^" in text
    # not vacuous: most expressions are computed, many of them with ^, and each promised refusal is met many times
    assert seen["accepted"] > CASES // 2 and seen["accepted with ^"] > CASES // 5, seen
    assert all(seen[reason] >= 50 for reason in ("division by zero", "non-integer exponent", "too large")), seen


@pytest.mark.timeout(120)
def test_tool_agrees_with_sympy_where_the_reference_accepts():
    sympy_parser = pytest.importorskip("sympy.parsing.sympy_parser")
    transformations = sympy_parser.standard_transformations + (sympy_parser.convert_xor, sympy_parser.rationalize)
    compared = 0
    for text in _cases():
        if "//" in text:  # sympy 1.14: Integer.__rfloordiv__ truncates a Rational left operand, so 0.4 // -3 is 0
            continue
        try:
            expected = _reference(text)  # only bounded expressions: sympy has no size limit and would hang on 9^9^9
        except Refused:
            continue
        value = sympy_parser.parse_expr(text, transformations=transformations, evaluate=True)
        assert value.is_Rational and Fraction(int(value.p), int(value.q)) == expected == evaluate(text), text
        compared += 1
    assert compared > CASES // 2, compared


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2*3^2", 18),
        ("7^2+1", 50),
        ("2^3^2", 512),
        ("-2^2", -4),
        ("(-2)^2", 4),
        ("2**3**2", 512),
        ("2^-1", Fraction(1, 2)),
        ("-2^-2", Fraction(-1, 4)),
        ("(2^3)^2", 64),
        ("2 ** 3 ^ 2", 512),
        ("10 - 2^3", 2),
        ("12 / 2^2", 3),
        ("2^3 % 3", 2),
        ("1,000 ^ 2", 10**6),
        ("1.5^2", Fraction(9, 4)),
    ],
)
def test_caret_is_a_power_with_the_precedence_of_double_star(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "attempt",
    [
        "'2^3'",
        "2 ^= 3",
        "2 ^ ^ 3",
        "2 ^",
        "^ 2",
        "2 ^ 0.5",
        "9 ^ 9 ^ 9",
        "0 ^ -1",
        "x ^ 2",
        "(2 ^ 3",
        "2 ^ (1 < 2)",
    ],
)
def test_caret_opens_no_new_input(attempt):
    with pytest.raises(CalculatorError):
        evaluate(attempt)


def test_description_says_what_is_accepted_and_refused():
    schema = tool_schema(calculator)["function"]
    shown = schema["description"] + " " + schema["parameters"]["properties"]["expression"]["description"]
    for needle in (
        "^ (power)",
        "decimals",
        "parentheses",
        "names",
        "calls",
        "/0",
        "fractional powers",
        f">{MAX_DIGITS} digits",
    ):
        assert needle in shown, needle
    example = re.search(r'e\.g\. "([^"]+)"', shown).group(1)
    assert evaluate(example) == _reference(example)
    # the docstring's fuller text (not sent to the model) states the limits and worked examples; they must be right
    doc = inspect.getdoc(calculator)
    for needle in (f"{MAX_DIGITS} digits", f"{MAX_DEPTH} levels", f"{MAX_CHARS} characters", "division by zero"):
        assert needle in doc, needle
    examples = re.findall(r"([-\d*^]+) is (-?\d+)", " ".join(doc.split()))  # "2*3^2 is 18"
    assert len(examples) >= 3 and all(evaluate(expr) == int(value) for expr, value in examples), examples
