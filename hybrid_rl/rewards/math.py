"""A numeric final-answer verifier and the `gsm8k` reward built on it.

Extraction (from a completion):
  strict    the number right after the LAST `####` (GSM8K's answer format; the model
            must also get the format right). Text after the number is ignored.
  flexible  the last number anywhere in the text.
Normalisation: thousands separators (`1,800`), `$`, a unicode minus, units and
trailing punctuation (`18 dollars.`) are dropped, a minus sign is read only where
it cannot be a subtraction (`5-3` ends in 3); `3/4` is a fraction. Comparison
is numeric and exact (`18` == `18.0` == `18.00`, `0.75` == `3/4`), on fractions, so
no float tolerance decides a reward.

A completion cut at `max_new_tokens` (finish_reason "length") whose number runs to
the very end of the text earns nothing for it: `#### 1` cut from `#### 18` must not
score, and the verifier cannot tell the two apart.

Scores (verl's gsm8k `compute_score` convention, which cites ReFT, Trung et al. 2024):
correct 1.0; an answer in the right form but wrong `format_score` (default 0);
no answer 0. The match itself is more lenient than verl's text comparison (`#### 18.00`,
`#### $18` and `####18` are right against 18 here, wrong or absent there); mode `verl`
reproduces verl's match exactly, for curves comparable with verl's.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional, Sequence

from hybrid_rl.rewards.base import register_reward

MODES = ("strict", "flexible")

# A number: comma-grouped thousands or plain digits, optional decimals, optional
# "/denominator"; or a bare ".5". A minus sign counts only where it cannot be a
# subtraction (`5-3` holds 5 and 3, not -3). Group 1: the sign, group 2: the digits.
_DIGITS = r"((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|\.\d+)"
_NUMBER_RE = re.compile(r"(?:((?<![\w).])-)\s*\$?)?(?<![\d.])" + _DIGITS)
# Right after `####`: spaces, an optional `$` (either side of a sign), then the number.
_AFTER_HASHES_RE = re.compile(r"\s*(?:\$\s*)?(-?)\s*(?:\$\s*)?" + _DIGITS)
# What may follow a number cut by truncation and still leave it possibly incomplete.
_CUT_TAIL_RE = re.compile(r"[.,/]*")


def _clean(text: str) -> str:
    return text.replace("\u2212", "-")  # the unicode minus sign, as models and typesetting write it


def parse_number(token: str) -> Optional[Fraction]:
    """`token` (one number as matched by the extractors) as an exact fraction; None if it is not one."""
    s = token.replace(",", "").replace(" ", "")
    try:
        if "/" in s:
            num, den = s.split("/")
            return Fraction(Fraction(num), Fraction(den)) if Fraction(den) != 0 else None
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str, mode: str = "strict") -> Optional[tuple[Fraction, int]]:
    """(the final answer, the index in `text` where its number ends), or None when there is none."""
    if mode not in MODES:
        raise ValueError(f"math answer mode must be one of {list(MODES)}, got {mode!r}")
    text = _clean(text)
    if mode == "strict":
        at = text.rfind("####")
        m = _AFTER_HASHES_RE.match(text, at + 4) if at >= 0 else None
        value = parse_number(m.group(1) + m.group(2)) if m is not None else None
        return (value, m.end()) if value is not None else None
    for m in reversed(list(_NUMBER_RE.finditer(text))):
        value = parse_number((m.group(1) or "") + m.group(2))
        if value is not None:
            return value, m.end()
    return None


def reference_answer(answer: str) -> Optional[Fraction]:
    """The ground truth in a dataset's answer: after its last `####` if it has one, else the whole
    string as one number (`"1,800"`, `"-3"`, `"$0.5"`); None if neither."""
    if "####" in answer:
        found = extract_answer(answer, "strict")
        return found[0] if found is not None else None
    m = _AFTER_HASHES_RE.fullmatch(_clean(answer).strip().rstrip("."))
    return parse_number(m.group(1) + m.group(2)) if m is not None else None


def score_answer(
    completion: str, reference: Fraction, mode: str = "strict", format_score: float = 0.0, truncated: bool = False
) -> float:
    """1.0 if the completion's final answer equals `reference`, `format_score` if it has one that
    does not, 0.0 if it has none (or only one that a truncation may have cut short)."""
    found = extract_answer(completion, mode)
    if found is None:
        return 0.0
    value, end = found
    if truncated and _CUT_TAIL_RE.fullmatch(completion[end:]):
        return 0.0  # nothing but the cut after the number: `#### 1` may have been `#### 18`
    return 1.0 if value == reference else float(format_score)


def _answer_text(row: dict) -> str:
    """The row's reference answer as text: `ground_truth` (set by the gsm8k loader) or else its `answer`."""
    return str(row["ground_truth"] if "ground_truth" in row else row["answer"])


def _reference(meta: dict) -> Fraction:
    """The row's ground truth as a number (`_answer_text`)."""
    text = _answer_text(meta)
    ref = reference_answer(text)
    if ref is None:
        raise ValueError(f"the row's answer {text[-80:]!r} holds no number to check against")
    return ref


def check_math_rows(rows: Sequence[dict], source: str) -> None:
    """Every row must carry a reference answer the verifier can read; names the first that does not."""
    for i, row in enumerate(rows):
        if "answer" not in row and "ground_truth" not in row:
            raise ValueError(
                f"{source}: row {i} has no 'answer' (config key 'data.answer_key'); the math reward "
                f"checks completions against it; row: {str(row)[:120]}"
            )
        text = _answer_text(row)
        if reference_answer(text) is None:
            raise ValueError(
                f"{source}: row {i}: answer {text[-80:]!r} has no final number "
                "(expected '#### <number>' or a bare number)"
            )


# verl's strict GSM8K match: "#### " (one space), then a run of digits, dots and commas with an optional minus.
_VERL_ANSWER_RE = re.compile(r"#### (-?[0-9.,]+)")


def verl_score(completion: str, reference: str, format_score: float = 0.0) -> float:
    """verl's gsm8k `compute_score` (method strict), for curves comparable with verl's: the LAST
    `#### <number>` of the completion, commas dropped, equal AS TEXT to the reference's (its first
    `#### <number>`, commas dropped, or the whole string). So `#### 18.00`, `#### 18.` get format_score
    against 18, `####18` and `#### $18` have no answer, and a truncation is not special."""
    found = _VERL_ANSWER_RE.findall(completion)
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "") == reference else float(format_score)


def verl_reference(meta: dict) -> str:
    text = _answer_text(meta)
    m = _VERL_ANSWER_RE.search(text)
    return (m.group(1) if m is not None else text.strip()).replace(",", "")


@register_reward("gsm8k", check_rows=check_math_rows)
def gsm8k_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[dict],
    mode: str = "strict",
    format_score: float = 0.0,
) -> list[float]:
    """GSM8K-style numeric answer reward; `reward.kwargs.mode` / `reward.kwargs.format_score` set the options.

    mode: strict / flexible (this module's verifier: numbers compared exactly as numbers, a cut-off
    answer scores nothing), or verl (`verl_score`: verl's own text match, to compare curves with verl's)."""
    if mode == "verl":
        return [verl_score(c, verl_reference(m), format_score) for c, m in zip(completions, metadata)]
    if mode not in MODES:
        raise ValueError(f"reward.kwargs.mode must be one of {[*MODES, 'verl']}, got {mode!r}")
    return [
        score_answer(c, _reference(m), mode, format_score, truncated=m.get("finish_reason") == "length")
        for c, m in zip(completions, metadata)
    ]


@register_reward("gsm8k_format")
def gsm8k_format_reward(prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]) -> list[float]:
    """GSM8K's answer format alone, right or wrong: a strict `#### <number>` final answer 1.0; a
    `####` with a number somewhere after it (the parts in order, not yet together) 0.5; else 0.
    (Credit for a bare `####` teaches a policy to repeat the marker and never write a number.) A
    shaping reward, as format rewards in GRPO recipes are; the CPU demo trains a tiny model on it."""
    out = []
    for c, m in zip(completions, metadata):
        truncated = m.get("finish_reason") == "length"
        found = extract_answer(c, "strict")
        if found is not None and not (truncated and _CUT_TAIL_RE.fullmatch(c[found[1] :])):
            out.append(1.0)
            continue
        at = c.find("####")
        later = extract_answer(c[at + 4 :], "flexible") if at >= 0 else None
        out.append(
            0.5 if later is not None and not (truncated and _CUT_TAIL_RE.fullmatch(c[at + 4 + later[1] :])) else 0.0
        )
    return out
