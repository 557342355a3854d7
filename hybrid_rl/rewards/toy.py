"""Verifiable toy tasks small enough to learn on a CPU in minutes.

"digits": the prompt is three digits, the answer is each digit plus one (mod 10),
then EOS (its rows and vocabulary: data/digits.py). A uniform-random policy over the vocabulary scores about 0.06.

Importing this module registers its rewards; `rewards.base.get_reward` does that import.
"""

from __future__ import annotations

from typing import Sequence

from hybrid_rl.rewards.base import register_reward


@register_reward("digits")
def digits_reward(prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]) -> list[float]:
    """0.9 x fraction of the 3 answer digits right in place + 0.1 for stopping right after them."""
    out = []
    for text, meta in zip(completions, metadata):
        answer = meta["answer"]
        got = "".join(text.split())
        right = sum(a == b for a, b in zip(answer, got))
        stopped = meta["finish_reason"] == "stop" and meta["response_tokens"] == len(answer)
        out.append(0.9 * right / len(answer) + 0.1 * stopped)
    return out
