"""The step's shared data types, at the bottom of the package: what an engine returns and is asked for.

Every layer reads them (the batch, rewards, dynamic sampling, the split placement's queue, the engines), so they
live here and import nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop_token_ids: tuple[int, ...] = ()  # EOS is always a stop token
    greedy: bool = False
    seed: int = 0
    min_new_tokens: int = 0  # no stop token (EOS or stop_token_ids) before this many tokens (vLLM's min_tokens)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}; use greedy=True for argmax decoding")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Completion:
    """One sampled continuation.

    token_ids include the stop token when one was produced. logprobs[i] is the
    log-probability of token_ids[i] under log_softmax(logits / temperature), before
    top-k / top-p filtering (SGLang's convention).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"

    @property
    def generated_tokens(self) -> int:
        """Tokens the model sampled: what `response/length` counts (an episode's observations are not)."""
        return len(self.token_ids)

    @property
    def truncated(self) -> bool:
        """Cut by a length limit instead of ending by itself: what `response/truncated` counts."""
        return self.finish_reason == "length"


def response_bodies(completions: Sequence[Completion], stop_ids: set[int]) -> list[list[int]]:
    """Each completion's tokens without a final stop token: what rewards and validation read."""
    return [
        c.token_ids[:-1] if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in stop_ids else c.token_ids
        for c in completions
    ]
