"""Partial rollouts on SGLang (issue 37): one streamed generate that stops once enough groups are done.

What SGLang 0.5.21 offers a caller of the offline `sglang.Engine` (read in its source; shared/notes/sglang-api.md
section 10):
  * `generate(..., stream=True, rid=[...])` returns an iterator; each item is one request's output so far, "index"
    its position in the batch, and a request's last item carries its finish_reason and its whole output
    (output_ids, meta_info.output_token_logprobs). Nothing is sent before the first item is asked for.
  * `engine.tokenizer_manager.abort_request(rid=...)` (what SGLang's own /abort_request route calls): a running
    request samples one more token and finishes {"type": "abort", ...} with every token it has; one still queued
    finishes with the tokens the engine had sent so far (none unless it was retracted). A rid already finished is
    dropped. The scheduler aborts every request whose rid *starts with* the one given, so rids here are uuid4 hex:
    one length, all distinct, none a prefix of another.
  * A streamed request sends an item every `stream_interval` tokens (the sampling parameter; the server's default
    is every token) besides its last: STREAM_INTERVAL keeps the items few while bounding what a queued abort after
    a retraction can lose (the engine reports only what it had sent).
The owner of an engine group (engine.py) runs this on the engine's thread; every rank's PartialRequest is applied
to that rank's rows only, so each rank gets what its own call would.
"""

from __future__ import annotations

import time
import uuid
import warnings
from typing import Optional, Sequence

from hybrid_rl.types import PartialRequest, RankGroups

STREAM_INTERVAL = 64
SETTLE_S = 60.0  # how long a failed partial rollout waits for SGLang's aborted requests to end


class GroupStops:
    """Each rank's PartialRequest over its rows of one group call (rows numbered rank after rank; types.RankGroups
    counts their groups): once a rank has `groups_needed` groups with every row finished, its other rows are stopped.
    A rank without a PartialRequest runs every row to its end."""

    def __init__(self, partials: Sequence[Optional[PartialRequest]], counts: Sequence[int]):
        self.groups = RankGroups(partials, counts)
        self.rank_of = self.groups.rank_of
        starts = [sum(counts[:k]) for k in range(len(counts))]
        self.rows = [list(range(a, a + n)) for a, n in zip(starts, counts)]  # each rank's rows
        self.finished = [False] * len(self.rank_of)

    def met(self, k: int) -> bool:
        return self.groups.met(k)

    def finish(self, row: int) -> list[int]:
        """Row `row` finished ("stop" or "length"): the rows to stop now (its rank's unfinished rows, once its groups
        are enough; none otherwise, or if they were stopped already)."""
        k = self.rank_of[row]
        was_met = self.met(k)
        self.finished[row] = True
        self.groups.finish(row)
        if was_met or not self.met(k):
            return []
        return [i for i in self.rows[k] if not self.finished[i]]


def stream_until_enough(
    engine, ids: list[list[int]], sampling: list[dict], stops: GroupStops, sent: list[int], lora_path: Optional[list]
) -> tuple[dict[int, dict], set[int], float]:
    """Run rows `sent` (group rows) in one streamed generate of `engine` (an sglang.Engine), stopping each rank's
    rest once its groups are done.

    Returns each sent row's last output (by group row), the rows this call aborted, and the tail: seconds from the
    finish that left fewer than half of the sent rows decoding to the last one (rows count as decoding until their
    last output arrives). On a failure the engine is left idle before the error goes on (`_settle`)."""
    rids = [uuid.uuid4().hex for _ in sent]
    row_of = dict(enumerate(sent))
    rid_of_row = dict(zip(sent, rids))
    outs: dict[int, dict] = {}
    aborted: set[int] = set()
    done_at: list[float] = []
    start = time.perf_counter()
    chunks = engine.generate(
        input_ids=[ids[i] for i in sent],
        sampling_params=[dict(sampling[i], stream_interval=STREAM_INTERVAL) for i in sent],
        return_logprob=True,
        lora_path=lora_path,
        stream=True,
        rid=rids,
    )
    try:
        for chunk in chunks:
            if chunk["meta_info"].get("finish_reason") is None:
                continue  # an item of a request still running
            row = row_of[chunk["index"]]
            outs[row] = chunk
            done_at.append(time.perf_counter() - start)
            if chunk["meta_info"]["finish_reason"].get("type") in ("stop", "length"):
                for other in stops.finish(row):
                    if other not in aborted and other not in outs:
                        aborted.add(other)
                        engine.tokenizer_manager.abort_request(rid=rid_of_row[other])
    except BaseException:
        _settle(engine, [rid_of_row[row] for row in sent if row not in outs], chunks)
        raise
    missing = [i for i in sent if i not in outs]
    if missing:
        raise RuntimeError(f"SGLang's stream ended without a final output for {len(missing)} of {len(sent)} requests")
    return outs, aborted, tail_seconds(done_at)


def _settle(engine, running: list[str], chunks, wait_s: float = SETTLE_S) -> None:
    """After a failure inside the stream: abort the requests still running, read out the stream if it still runs,
    and wait until the engine is idle (flush_cache succeeds only then; slime retries it the same way). A request
    left running makes the next release fail SGLang's idle assertion, which kills this process."""
    for rid in running:
        engine.tokenizer_manager.abort_request(rid=rid)
    try:
        for _ in chunks:
            pass
    except Exception:  # noqa: BLE001 - the first failure is the one to report
        pass
    deadline = time.monotonic() + wait_s
    while not engine.flush_cache().success:
        if time.monotonic() > deadline:
            warnings.warn(f"SGLang still runs aborted requests {wait_s:.0f} s after a failed partial rollout")
            return
        time.sleep(0.05)


def tail_seconds(done_at: Sequence[float]) -> float:
    """Seconds, up to the last finish, during which fewer than half of the rows were still running: after the
    (n // 2 + 1)-th finish of n rows."""
    if not done_at:
        return 0.0
    ordered = sorted(done_at)
    return ordered[-1] - ordered[len(ordered) // 2]
