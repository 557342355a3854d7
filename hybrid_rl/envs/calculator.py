"""A calculator tool: arithmetic evaluated by walking Python's AST over a whitelist, never `eval`.

The expression comes from a policy being trained, so it is hostile input: `ast.parse` only
builds a tree (it runs nothing), and the walk below accepts numbers, + - * / // % **, unary
signs and parentheses; any other node (a name, a call, an attribute, a lambda, a string, a
comprehension) is refused with the node's kind. People write `^` for a power, so every `^`
operator token becomes `**` before parsing: Python's own grammar then gives it a power's
precedence and right associativity (2*3^2 is 18, 2^3^2 is 512, -2^2 is -4), which reading the
parsed XOR node as a power would not. Sizes are bounded before they are computed: the text
length, the nesting depth, every intermediate's digit count and every power's result, so
`9**9**9` is refused instead of eating the CPU.
Arithmetic is exact on fractions (0.1 + 0.2 is 0.3) and only the answer is shown as a decimal.
"""

from __future__ import annotations

import ast
import io
import math
import re
import tokenize
from fractions import Fraction

MAX_CHARS = 200  # a GSM8K step is a few dozen characters
MAX_DEPTH = 30  # nesting of the tree; also keeps the walk's recursion shallow
MAX_DIGITS = 60  # the largest |value| allowed anywhere, in decimal digits (numerator and denominator)

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}
_UNARY = {ast.UAdd: lambda a: a, ast.USub: lambda a: -a}
# Thousands separators between digits ("1,200"), and the multiplication/division signs people type.
_GROUPING = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_SIGNS = {"\u00d7": "*", "\u00f7": "/", "\u2212": "-"}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or too large; the message says which part."""


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, or CalculatorError saying why it is refused."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    for sign, op in _SIGNS.items():
        text = text.replace(sign, op)
    text = _GROUPING.sub("", text)
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(_caret_as_power(text), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, tokenize.TokenError) as err:
        raise CalculatorError(f"not an arithmetic expression ({type(err).__name__})") from None
    return _walk(tree.body, 0)


def _caret_as_power(text: str) -> str:
    """`text` with every `^` operator written `**`.

    Rewriting tokens rather than characters leaves a `^` inside a string or a comment alone, and `^=` (one
    token) stays an assignment, which eval mode refuses."""
    # tokenize numbers rows from 1 and columns in characters; StringIO's readline splits lines at "\n" only
    line_starts = [0]
    for line in text.split("\n"):
        line_starts.append(line_starts[-1] + len(line) + 1)
    carets = [
        line_starts[tok.start[0] - 1] + tok.start[1]
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.exact_type == tokenize.CIRCUMFLEX
    ]
    for at in reversed(carets):  # right to left, so the offsets still to come stay valid
        text = text[:at] + "**" + text[at + 1 :]
    return text


def _walk(node: ast.AST, depth: int) -> Fraction:
    """Evaluate a whitelisted node; everything else is refused by its AST class name."""
    if depth > MAX_DEPTH:
        raise CalculatorError(f"expression nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        value = node.value
        # bool is an int subclass; complex, str and bytes are not arithmetic on real numbers here
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {type(value).__name__} {value!r:.40}")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("number out of range")
        return _bounded(Fraction(repr(value)) if isinstance(value, float) else Fraction(value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand, depth + 1))
    if isinstance(node, ast.BinOp):
        left, right = _walk(node.left, depth + 1), _walk(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if type(node.op) in _BINARY:
            if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                raise CalculatorError("division by zero")
            return _bounded(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** ^ and parentheses")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """base ** exponent for an integer exponent whose result stays within MAX_DIGITS, checked BEFORE computing."""
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are supported")
    e = exponent.numerator
    if base == 0:
        if e < 0:
            raise CalculatorError("division by zero")
        return Fraction(int(e == 0))
    # digits of the result ~ |e| * log10 of the larger of |numerator|, denominator
    size = max(abs(base.numerator), base.denominator)
    if size > 1 and abs(e) * math.log10(size) > MAX_DIGITS:
        raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)")
    if size == 1 and abs(e) > 10**6:  # (+-1) ** e: tiny result, but Fraction.__pow__ still loops over bits
        e = e % 2 if e >= 0 else -(abs(e) % 2)
    return _bounded(base**e)


def _bounded(value: Fraction) -> Fraction:
    limit = 10**MAX_DIGITS
    if abs(value.numerator) >= limit or value.denominator >= limit:
        raise CalculatorError(f"number too large (more than {MAX_DIGITS} digits)")
    return value


def format_value(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal of up to 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def calculator(expression: str) -> str:
    """Exact arithmetic; no names, calls, /0, fractional powers, >60 digits.

    The first paragraph and the Args line are the tool's description in every episode's system prompt, so
    they stay short. In full: + - * / // % and ** or ^ on integers and decimals, unary signs and parentheses,
    where ^ is a power with the precedence and right associativity of ** (2*3^2 is 18, 2^3^2 is 512, -2^2 is
    -4); thousands separators (1,200) and the times and division signs are read too. Refused, with a message
    saying why: names, calls, text, containers, comparisons, division by zero, exponents that are not whole
    numbers, any value over 60 digits (final or intermediate), nesting deeper than 30 levels and expressions
    longer than 200 characters. The answer is an integer, else a decimal of up to 10 significant digits.

    Args:
        expression: Numbers with + - * / // % ** ^ (power), decimals, parentheses, e.g. "3^2/4".
    """
    return format_value(evaluate(expression))
