"""The `math` reward: LaTeX final answers (MATH-style) checked by `math-verify`, not hand-written parsing.

math-verify (Hugging Face; the verifier TRL's and open-r1's accuracy rewards use) extracts the
answer from the completion (a `\\boxed{}` first, else the last LaTeX or plain expression),
parses it into sympy and compares it with the reference symbolically: `\\frac{1}{2}` = `0.5`,
`(x+1)^2` = `x^2+2x+1`, intervals and sets as such. Hand-written normalisation misses too many
of these; GSM8K's numeric `####` check stays in rewards/math.py, unchanged.

Reference: the row's `ground_truth`, else `answer`, else `solution` (MATH's worked solution,
whose `\\boxed{}` holds the answer). A bare reference (`\\frac{1}{2}`) is read as inline math.
A completion cut at max_new_tokens (finish_reason "length") counts only a closed `\\boxed{}`:
any other trailing expression may have been cut short (`12` of `125`).

math-verify bounds its parsing with SIGALRM, which only the main thread may set; off the main
thread (an environment's step thread) it runs without that bound.
"""

from __future__ import annotations

import threading
from typing import Sequence

from hybrid_rl.rewards.base import register_reward

_KEYS = ("ground_truth", "answer", "solution")


def _math_verify():
    try:
        import math_verify
    except ImportError as err:
        raise ImportError(
            "reward 'math' needs math-verify: pip install 'hybrid_rl[math]' (or pip install math-verify)"
        ) from err
    return math_verify


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def reference_text(row: dict) -> str:
    for key in _KEYS:
        if key in row and row[key] is not None:
            return str(row[key])
    raise KeyError(f"the row has none of {list(_KEYS)} to check the answer against")


def parse_reference(text: str) -> list:
    """The reference parsed by math-verify (an empty list when nothing in it parses)."""
    mv = _math_verify()
    wrapped = text if ("$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text) else f"${text}$"
    return mv.parse(wrapped, parsing_timeout=_timeout())


def score(completion: str, reference: list, truncated: bool = False) -> float:
    """1.0 if the completion's final answer equals the parsed reference, else 0.0."""
    mv = _math_verify()
    if truncated:
        config = [mv.LatexExtractionConfig(try_extract_without_anchor=False, boxed_match_priority=0)]
        parsed = mv.parse(completion, extraction_config=config, parsing_timeout=_timeout())  # unanchored: boxed only
    else:
        parsed = mv.parse(completion, parsing_timeout=_timeout())
    if not parsed or not reference:
        return 0.0
    return 1.0 if mv.verify(reference, parsed, timeout_seconds=_timeout()) else 0.0


def check_latex_rows(rows: Sequence[dict], source: str) -> None:
    """Every row must carry a reference math-verify can parse; names the first that does not."""
    for i, row in enumerate(rows):
        try:
            text = reference_text(row)
        except KeyError as err:
            raise ValueError(f"{source}: row {i}: {err.args[0]}; row: {str(row)[:120]}") from None
        if not parse_reference(text):
            raise ValueError(f"{source}: row {i}: math-verify cannot parse the reference answer {text[-80:]!r}")


@register_reward("math", check_rows=check_latex_rows)
def math_reward(prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]) -> list[float]:
    """MATH-style LaTeX answers, verified symbolically by math-verify (module docstring)."""
    return [
        score(c, parse_reference(reference_text(m)), truncated=m.get("finish_reason") == "length")
        for c, m in zip(completions, metadata)
    ]
