"""GSM8K (Cobbe et al. 2021): grade-school math word problems, answers ending in `#### <number>`.

Where the rows come from, in order:
  1. `data.path`: a directory with train/test as .jsonl or .parquet (or one file: train only);
  2. `../shared/data/gsm8k/` beside the repository (the copy every developer machine and CI has);
  3. the `openai/gsm8k` dataset ("main" config) through `datasets`, when installed and reachable.
The rows are the same in all three: {"question", "answer"}.

Each row becomes {"prompt": question + " " + instruction, "question", "answer",
"ground_truth"}: the number after the answer's `####` (kept as written, e.g. "1,200";
the reward normalises it). The instruction is verl's GSM8K preprocessing prompt
(examples/data_preprocess/gsm8k.py in volcengine/verl), so rewards match its format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from hybrid_rl.data.rows import DataError, DataFileMissing

HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_dirs() -> list[str]:
    """Where a local copy is looked for when `data.path` is empty: beside the repository, then the cwd."""
    here = os.path.normpath(os.path.join(_REPO, "..", "shared", "data", "gsm8k"))
    cwd = os.path.normpath(os.path.join(os.getcwd(), "..", "shared", "data", "gsm8k"))
    return [here] if here == cwd else [here, cwd]


@dataclass
class RawSplits:
    train: list[dict]
    test: Optional[list[dict]]  # None when only a training file was given
    train_source: str
    test_source: str


def _split_file(directory: str, split: str) -> Optional[str]:
    for ext in (".jsonl", ".parquet"):
        path = os.path.join(directory, split + ext)
        if os.path.isfile(path):
            return path
    return None


def _from_dir(directory: str) -> RawSplits:
    from hybrid_rl.data.rows import read_rows

    train, test = _split_file(directory, "train"), _split_file(directory, "test")
    if train is None:
        raise DataFileMissing(
            f"data.path {directory!r} holds no train.jsonl or train.parquet (GSM8K layout: "
            'train.jsonl and test.jsonl of {"question", "answer"} rows)'
        )
    return RawSplits(read_rows(train), read_rows(test) if test else None, train, test or "")


def _from_hub() -> RawSplits:
    import datasets  # optional: only this path needs it

    ds = datasets.load_dataset(HUB_NAME, HUB_CONFIG)
    return RawSplits(
        [dict(r) for r in ds["train"]], [dict(r) for r in ds["test"]], f"{HUB_NAME}:train", f"{HUB_NAME}:test"
    )


def load_splits(path: str = "") -> RawSplits:
    """GSM8K's train and test rows, from `path`, the local copy, or the hub (module docstring)."""
    from hybrid_rl.data.rows import read_rows

    if path:
        if os.path.isdir(path):
            return _from_dir(path)
        return RawSplits(read_rows(path), None, path, "")
    for directory in default_dirs():
        if _split_file(directory, "train"):
            return _from_dir(directory)
    try:
        return _from_hub()
    except Exception as err:  # ImportError (no `datasets`) or no network: say what was tried
        tried = ", ".join(default_dirs())
        raise DataFileMissing(
            f"GSM8K not found: no train.jsonl in {tried}, and {HUB_NAME} could not be loaded "
            f"through `datasets` ({type(err).__name__}: {err}). Set data.path to a directory "
            "holding train.jsonl and test.jsonl"
        ) from err


def final_answer(answer: str) -> Optional[str]:
    """The text after the last `####` of a GSM8K answer, stripped; None without one (or if empty)."""
    if "####" not in answer:
        return None
    tail = answer.rsplit("####", 1)[1].strip()
    return tail or None


def make_row(raw: dict, i: int, instruction: str, source: str) -> dict:
    """A GSM8K row for training (module docstring); a row without question or `#### answer` is an error."""
    question, answer = (raw.get("question"), raw.get("answer")) if isinstance(raw, dict) else (None, None)
    if not isinstance(question, str) or not question.strip():
        raise DataError(
            f"{source}: row {i} has no non-empty string under 'question' (GSM8K rows are "
            f'{{"question", "answer"}}); row: {str(raw)[:120]}'
        )
    if not isinstance(answer, str):
        raise DataError(f"{source}: row {i} has no string under 'answer'; row: {str(raw)[:120]}")
    truth = final_answer(answer)
    if truth is None:
        raise DataError(
            f"{source}: row {i}: the answer does not end in '#### <number>' (GSM8K's final-answer "
            f"format, which the strict reward checks against); answer: {answer[-120:]!r}"
        )
    prompt = f"{question} {instruction}" if instruction else question
    return {**raw, "prompt": prompt, "ground_truth": truth}
