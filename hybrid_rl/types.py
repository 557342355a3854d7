"""The step's shared data types, at the bottom of the package: what an engine returns and is asked for.

Every layer reads them (the batch, rewards, dynamic sampling, the split placement's queue, the engines), so they
live here and import nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence


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
    finish_reason: str  # "stop" | "length" | "abort" (a partial rollout stopped it unfinished: tokens so far)
    # The policy version of each token when weights changed during the call (trainer.inflight_update=continue:
    # split/inflight.py sets it); None: every token was sampled by the weights the engine held at the call's start.
    versions: Optional[list[int]] = None

    @property
    def generated_tokens(self) -> int:
        """Tokens the model sampled: what `response/length` counts (an episode's observations are not)."""
        return len(self.token_ids)

    @property
    def truncated(self) -> bool:
        """Cut by a length limit instead of ending by itself: what `response/truncated` counts."""
        return self.finish_reason == "length"


@dataclass(frozen=True)
class PartialRequest:
    """What a partial rollout (issue 37, `rollout.partial`) asks of an engine beside the prompts.

    Row i may continue a carried sample whose generated prefix already ends `prompt_ids[i]` (ids, never
    re-tokenized text): it samples at most `max_new_tokens[i]` more tokens (the sample's budget less its prefix),
    and no stop token before `min_new_tokens[i]`. `group_of[i]` names its group. The engine stops decoding once
    `groups_needed` groups have every row they sent finished ("stop" or "length"), and returns each unfinished row
    as it stands: finish_reason "abort", the tokens and log-probs it sampled so far (possibly none). With
    groups_needed at least the number of groups, every row runs to its end, as without a PartialRequest.
    `SamplingParams.max_new_tokens` must be at least the largest budget (engines size their cache from it).

    rollout.partial_kv=keep (the native engine): with `keep_kv` the engine returns, in its `last_kept_kv`, each
    unfinished row's keys and values (host tensors) of every token it fed, so the next call continues the row over
    them instead of recomputing them: `kv[i]` (empty, or one entry per row, None for a row without) is row i's, and
    then covers all of `prompt_ids[i]` but its last token, which was sampled and never fed.
    """

    max_new_tokens: tuple[int, ...]
    min_new_tokens: tuple[int, ...]
    group_of: tuple[int, ...]
    groups_needed: int
    kv: tuple[Any, ...] = ()
    keep_kv: bool = False

    def __post_init__(self) -> None:
        n = len(self.max_new_tokens)
        if len(self.min_new_tokens) != n or len(self.group_of) != n or len(self.kv) not in (0, n):
            raise ValueError(
                f"PartialRequest: max_new_tokens, min_new_tokens and group_of (and kv, when given) need one entry "
                f"per row, got {n}, {len(self.min_new_tokens)}, {len(self.group_of)} and {len(self.kv)}"
            )
        for i, (hi, lo) in enumerate(zip(self.max_new_tokens, self.min_new_tokens)):
            if hi < 1 or not 0 <= lo <= hi:
                raise ValueError(f"PartialRequest row {i}: needs 0 <= min_new_tokens={lo} <= max_new_tokens={hi}, >= 1")
        if self.groups_needed < 0:
            raise ValueError(f"PartialRequest: groups_needed must be >= 0, got {self.groups_needed}")

    def check(self, n_prompts: int, params: SamplingParams) -> None:
        """Refuse a request that does not match its prompts or its sampling parameters."""
        if len(self.max_new_tokens) != n_prompts:
            raise ValueError(f"PartialRequest has {len(self.max_new_tokens)} rows for {n_prompts} prompts")
        if self.max_new_tokens and max(self.max_new_tokens) > params.max_new_tokens:
            raise ValueError(
                f"PartialRequest: a row's budget {max(self.max_new_tokens)} exceeds "
                f"SamplingParams.max_new_tokens={params.max_new_tokens}"
            )


class WeightUpdates(Protocol):
    """Weight versions an engine takes between decode steps (trainer.inflight_update=continue, split/inflight.py).

    An engine given one calls `poll()` between its decode steps (and before each decode batch), where no forward is
    running; poll applies the versions it takes now through the engine's own weight-update API and returns how many
    (split/inflight.TakeOffered: those offered so far, but not one due for validation, the store read at most every
    10 ms). After the call the engine's `last_update_marks` holds, per applied version, the tokens each row of the call
    (in order) held when it took effect: tokens at or past a row's mark were sampled by that version or a newer one."""

    def poll(self) -> int: ...


def token_versions(
    marks: Sequence[Sequence[int]], row: int, n_tokens: int, start: int, applied: Sequence[int]
) -> list[int]:
    """The version of each of a row's `n_tokens` tokens: `start` (held at the call's start) until the row's mark
    of the first applied version, then `applied[u]` from its mark of update u on (marks: WeightUpdates)."""
    out = [start] * n_tokens
    for u, version in enumerate(applied):
        for j in range(max(0, marks[u][row]), n_tokens):
            out[j] = version
    return out


def groups_complete(group_of: Sequence[int], finished: Sequence[bool]) -> int:
    """How many groups have every row finished: the stop rule of a PartialRequest, on the host."""
    open_groups = {g for g, f in zip(group_of, finished) if not f}
    return len(set(group_of) - open_groups)


class RankGroups:
    """The stop rule of one engine call that holds several ranks' PartialRequests (a TP group's rows, or a shared
    SGLang engine's; rows numbered rank after rank), counted as rows finish instead of recounted (groups_complete is
    its naive statement). `finish(row)` once per finished row; `met(k)` once rank k has its `groups_needed` groups
    with every row finished. A rank without a PartialRequest counts its rows as one group, needed once: met when
    all of them finished, or at once when it has none."""

    def __init__(self, partials: Sequence[Optional[PartialRequest]], counts: Sequence[int]):
        self.rank_of: list[int] = []
        self.group_of: list[int] = []
        self.needed: list[int] = []
        self._open: dict[tuple[int, int], int] = {}  # unfinished rows per (rank, group)
        for k, (p, n) in enumerate(zip(partials, counts)):
            groups = p.group_of if p is not None else (0,) * n
            if len(groups) != n:
                raise ValueError(f"rank {k}: a PartialRequest of {len(groups)} rows for {n} prompts")
            self.needed.append(p.groups_needed if p is not None else min(1, n))
            for g in groups:
                self.rank_of.append(k)
                self.group_of.append(g)
                self._open[(k, g)] = self._open.get((k, g), 0) + 1
        self.complete = [0] * len(self.needed)  # each rank's groups with every row finished

    def finish(self, row: int) -> int:
        """Row `row` finished ("stop" or "length"); returns its rank."""
        k = self.rank_of[row]
        key = (k, self.group_of[row])
        self._open[key] -= 1
        if self._open[key] == 0:
            self.complete[k] += 1
        return k

    def met(self, k: int) -> bool:
        return self.complete[k] >= self.needed[k]

    def all_met(self) -> bool:
        return all(map(self.met, range(len(self.needed))))


def response_bodies(completions: Sequence[Completion], stop_ids: set[int]) -> list[list[int]]:
    """Each completion's tokens without a final stop token: what rewards and validation read."""
    return [
        c.token_ids[:-1] if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in stop_ids else c.token_ids
        for c in completions
    ]
