"""The digits toy task's prompts and vocabulary: three digits, answered by each digit plus one (mod 10).

Its reward is rewards/toy.py; the tiny models are built over `DIGIT_WORDS` (the ten digits and `=`).
"""

from __future__ import annotations

import random

DIGIT_WORDS = [str(d) for d in range(10)] + ["="]


def digits_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ds = [rng.randrange(10) for _ in range(3)]
        rows.append({"prompt": " ".join(map(str, ds)) + " =", "answer": "".join(str((d + 1) % 10) for d in ds)})
    return rows
