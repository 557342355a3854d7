"""Partial rollouts (issue 37, `rollout.partial`): no step waits for its longest completion.

A colocated step keeps more groups in flight than it trains (`rollout.partial_over` x this rank's
`data.batch_size` groups), asks the engine to stop once enough of them have every sample finished
(`rollout.partial_stop` of the batch; types.PartialRequest), trains the finished groups, oldest first, and carries
the rest. A carried sample keeps its prompt, the tokens it sampled, their behaviour log-probs and the policy
version of each token; the next rollout continues it from prompt + prefix as token ids (never re-sampling a token,
never re-tokenizing text) under the newer weights, beside new prompts. A group trains only when all its samples are
finished.

Versions. A colocated step s (0-based: the finished steps) generates with weights of version s and trains at
version s, so a token made at step v is trained at lag s - v: the split placement's `lag` and
`trainer.max_staleness` rule, read at the oldest token (split/staleness.py). A group whose oldest token is more
than k versions behind is dropped before the rollout and counted; with k = 0 every carried sample would be, so
config refuses `rollout.partial` with k = 0. The off-policy correction needs no change: each token's behaviour
log-prob is the one its engine reported (`RolloutBatch.engine_logp_NT`), and SCORE recomputes the old policy's.

rollout.partial_kv=keep (the native engine): a carried sample also holds the keys and values of every
token it fed (host tensors, PartialRequest.kv), and the next rollout continues it over them instead of recomputing its
prompt and prefix under the new weights: the tokens it samples then attend to a cache the older weights wrote, as
PipelineRL's in-flight updates do within a rollout. Their versions and the staleness rule are unchanged (the cache is
as old as the sample's oldest token, which the rule reads). A sample the engine did not start this time keeps its
cache; one that finishes, is cut or dropped lets it go.

This pool is the rank's run state: `state_dict` holds the rows drawn and not started (as dataset indices), the groups
in flight and every carried token, log-prob, version and kept cache, so a resumed run continues them to the bit
(loop/run_state.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from hybrid_rl.data.prompts import PromptLoader
from hybrid_rl.split.staleness import lag
from hybrid_rl.types import Completion, PartialRequest

UNFINISHED = "abort"


def stale_advice(samples: int, step: int, max_staleness: int) -> str:
    """What to do when the staleness rule drops carried samples (said once per run, by the rollout stage)."""
    return (
        f"rollout.partial dropped {samples} carried samples at step {step}: their oldest token was more than "
        f"trainer.max_staleness={max_staleness} versions behind. A carried sample advances about one short "
        "completion's length per step, so a completion L times longer than the short ones needs about L steps to "
        "finish: set trainer.max_staleness to at least L, or lower rollout.partial_over so that more steps wait for "
        "carried groups (docs/partial_rollouts.md, 'Sizing'). Every drop is counted in rollout/dropped_stale; this "
        "is said once per run."
    )


@dataclass
class Sample:
    """One sample of a group: its tokens so far with their log-probs and versions; finish_reason "abort" while
    unfinished; kv: the keys and values of every token it fed (rollout.partial_kv=keep), or None."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = UNFINISHED
    kv: Any = None

    @property
    def done(self) -> bool:
        return self.finish_reason != UNFINISHED

    def completion(self) -> Completion:
        return Completion(list(self.token_ids), list(self.logprobs), self.finish_reason)


@dataclass
class Group:
    """The G samples of one prompt, in flight since step `started`; `uid` orders groups by when they started."""

    row: dict
    prompt_ids: list[int]
    samples: list[Sample]
    started: int
    uid: int

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def oldest_version(self) -> Optional[int]:
        """The version of its oldest token (None: no token yet, so nothing in it can be stale)."""
        firsts = [s.versions[0] for s in self.samples if s.versions]
        return min(firsts) if firsts else None


@dataclass
class Plan:
    """One rollout's engine call: the prompts (prompt + carried prefix), its PartialRequest, and which sample each
    row continues."""

    prompt_ids: list[list[int]]
    request: PartialRequest
    targets: list[Sample]
    continued: int  # rows that continue a prefix of at least one token
    kept: int  # of them, rows sent with their kept cache (rollout.partial_kv=keep): not re-prefilled
    cut: int  # carried samples whose prefix already fills rollout.max_new_tokens: finished "length", not sent


class PartialRollouts:
    """This rank's partial-rollout pool: rows drawn and not started, and groups in flight (oldest first)."""

    def __init__(
        self,
        group_size: int,
        batch_groups: int,
        over: float,
        stop: float,
        max_new_tokens: int,
        min_new_tokens: int,
        rows: Sequence[dict],
        keep_kv: bool = False,
    ):
        """batch_groups: the groups a step trains on this rank (data.batch_size / ranks); over, stop:
        rollout.partial_over and rollout.partial_stop; rows: the dataset the loader draws from (a group's row is
        saved as its index in it, and comes back as the same object); keep_kv: rollout.partial_kv=keep."""
        self.keep_kv = keep_kv
        self.G, self.batch_groups, self.rows = group_size, batch_groups, rows
        self._index = {id(r): i for i, r in enumerate(rows)}
        self.in_flight = max(batch_groups, math.ceil(over * batch_groups))
        self.stop_groups = max(1, math.ceil(stop * batch_groups))
        self.max_new_tokens, self.min_new_tokens = max_new_tokens, min_new_tokens
        self.queue: list[tuple[dict, list[int]]] = []
        self.groups: list[Group] = []
        self.next_uid = 0

    # -- one step -------------------------------------------------------------------------------------------
    def drop_stale(self, step: int, max_staleness: int) -> tuple[int, int]:
        """Drop the groups whose oldest token is more than `max_staleness` versions behind step `step`'s weights
        (the split placement's rule); returns (groups, samples) dropped."""
        kept, stale = [], []
        for g in self.groups:
            old = g.oldest_version is not None and lag(step, g.oldest_version) > max_staleness
            (stale if old else kept).append(g)
        self.groups = kept
        return len(stale), sum(len(g.samples) for g in stale)

    def refill(self, step: int, loader: PromptLoader, encode: Callable[[dict], list[int]]) -> int:
        """Start new groups up to `in_flight`, from the rows drawn earlier and, when they run out, the loader's next
        batches (whole batches: the loader's position stays a batch boundary). Returns the groups started."""
        started = 0
        while len(self.groups) < self.in_flight:
            if not self.queue:
                self.queue = [(row, encode(row)) for row in loader.next_batch()]
            row, prompt = self.queue.pop(0)
            self.groups.append(Group(row, prompt, [Sample() for _ in range(self.G)], step, self.next_uid))
            self.next_uid += 1
            started += 1
        return started

    def plan(self) -> Plan:
        """The engine call: every unfinished sample, continued from its prefix with the rest of its budget; the stop
        once `stop_groups` groups are complete, counting those already complete."""
        prompts, hi, lo, group_of, targets, kv = [], [], [], [], [], []
        continued = cut = 0
        for gi, g in enumerate(self.groups):
            for s in g.samples:
                if s.done:
                    continue
                left = self.max_new_tokens - len(s.token_ids)
                if left <= 0:  # a resume with a smaller rollout.max_new_tokens: the prefix is the whole answer
                    s.finish_reason, s.kv = "length", None
                    cut += 1
                    continue
                prompts.append(g.prompt_ids + s.token_ids)
                hi.append(left)
                lo.append(max(0, self.min_new_tokens - len(s.token_ids)))
                group_of.append(gi)
                targets.append(s)
                kv.append(s.kv)  # None unless keep_kv (absorb and load_state_dict keep none then)
                continued += bool(s.token_ids)
        already = sum(g.complete for g in self.groups)
        needed = max(0, self.stop_groups - already)
        n_kept = sum(x is not None for x in kv)
        request = PartialRequest(
            tuple(hi), tuple(lo), tuple(group_of), needed, tuple(kv) if n_kept else (), self.keep_kv
        )
        return Plan(prompts, request, targets, continued, n_kept, cut)

    def absorb(
        self, plan: Plan, completions: list[Completion], version: int, kept: Sequence[Any] | None = None
    ) -> None:
        """The engine's results: each row's new tokens appended to its sample, tagged with `version`, or with the
        versions the completion carries (weights taken in flight: split/inflight.py); kept: the engine's
        `last_kept_kv` (keep_kv), each cut row's cache."""
        if len(completions) != len(plan.targets):
            raise RuntimeError(f"engine returned {len(completions)} completions for {len(plan.targets)} prompts")
        for i, (s, c) in enumerate(zip(plan.targets, completions)):
            s.token_ids += c.token_ids
            s.logprobs += c.logprobs
            s.versions += c.versions if c.versions is not None else [version] * len(c.token_ids)
            s.finish_reason = c.finish_reason
            new_kv = kept[i] if kept else None
            if s.done or not self.keep_kv:
                s.kv = None
            elif new_kv is not None or c.token_ids:  # a row not started keeps the cache it had
                s.kv = new_kv

    def complete_count(self) -> int:
        return min(self.batch_groups, sum(g.complete for g in self.groups))

    def take(self, n: int) -> list[Group]:
        """The n oldest complete groups, out of the pool (the rest stay carried)."""
        done = sorted((g for g in self.groups if g.complete), key=lambda g: g.uid)[:n]
        taken = {id(g) for g in done}
        self.groups = [g for g in self.groups if id(g) not in taken]
        return done

    # -- what the checkpoint holds -------------------------------------------------------------------------
    def carried_samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)

    def state_dict(self, caches: bool = True) -> dict:
        """Plain lists, ints, floats, strings and the kept caches' tensors (a checkpoint loads with
        weights_only=True). Every list is new: a step's undo holds it while the pool changes (trainer.step).
        caches=False: without the kept caches (a split rollout rank's report to the learners, which checkpoint it:
        a resumed split run re-prefills its carried samples once)."""
        return {
            "queue": [{"row": self._index[id(row)], "prompt_ids": list(p)} for row, p in self.queue],
            "groups": [
                {
                    "row": self._index[id(g.row)],
                    "prompt_ids": list(g.prompt_ids),
                    "started": g.started,
                    "uid": g.uid,
                    "samples": [
                        {
                            "token_ids": list(s.token_ids),
                            "logprobs": list(s.logprobs),
                            "versions": list(s.versions),
                            "finish_reason": s.finish_reason,
                            "kv": s.kv if caches else None,
                        }
                        for s in g.samples
                    ],
                }
                for g in self.groups
            ],
            "next_uid": self.next_uid,
        }

    def load_state_dict(self, state: dict) -> None:
        indices = [g["row"] for g in state["groups"]] + [q["row"] for q in state["queue"]]
        if any(not 0 <= i < len(self.rows) for i in indices):
            raise ValueError(
                f"the checkpoint's carried samples refer to row {max(indices)} of a dataset of {len(self.rows)} rows; "
                "resume with the dataset the run was started with"
            )
        groups = [
            Group(
                self.rows[g["row"]],
                list(g["prompt_ids"]),
                [
                    Sample(
                        list(s["token_ids"]),
                        list(s["logprobs"]),
                        list(s["versions"]),
                        s["finish_reason"],
                        s.get("kv") if self.keep_kv else None,  # partial_kv switched to recompute: recomputed
                    )
                    for s in g["samples"]
                ],
                int(g["started"]),
                int(g["uid"]),
            )
            for g in state["groups"]
        ]
        bad = [i for i, g in enumerate(groups) if len(g.samples) != self.G]
        if bad:
            raise ValueError(
                f"the checkpoint carries groups of {len(groups[bad[0]].samples)} samples, this run has rollout.n="
                f"{self.G}; resume with the same rollout.n"
            )
        self.queue = [(self.rows[q["row"]], list(q["prompt_ids"])) for q in state["queue"]]
        self.groups = groups
        self.next_uid = int(state["next_uid"])
