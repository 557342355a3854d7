"""A partial generate call of the vLLM engine (rollout/vllm/engine.py) through vLLM's own engine loop, and the
partial rollout's stop rule over it.

Why not `LLM.generate`: it blocks until every request has finished (entrypoints/common/offline.py `_run_engine`:
`while llm_engine.has_unfinished_requests(): llm_engine.step()`), so a partial rollout (types.PartialRequest)
could not stop once enough groups are done. `run` is that loop, held here: the requests go in as `LLM.generate`
adds them (the prompts rendered by the LLM's renderer, `renderer.render_cmpl`, then `LLMEngine.add_request(
request_id, prompt, params, lora_request=...)` with an id from the LLM's own counter, in order), and
`LLMEngine.step()` is called until none is left or the rule says enough. The same requests in the same order through
the same steps: a PartialRequest that stops nothing samples exactly what `LLM.generate` samples
(tests/unit/rollout/vllm/test_vllm_partial.py compares them), and the loop measures the rollout's tail on the way.

Outputs. A partial call asks for `RequestOutputKind.CUMULATIVE` (engine.build_requests; `LLM.generate` asks for
FINAL_ONLY, a report only when a request finishes): every step reports each request it advanced with all its tokens
and log-probs so far (without a tokenizer vLLM hands out its own growing lists, no copy: v1/engine/detokenizer.py
`IncrementalDetokenizer.output_token_ids`, v1/engine/output_processor.py `_new_completion_output`), so when the
rule stops the call each unfinished row's latest report is its prefix.

The stop. After each step that finished a row, `RankGroups.all_met()` (types.py: every rank's PartialRequest,
a rank without one needing all its rows); once true, the unfinished rows are aborted
with `LLMEngine.abort_request(internal_ids, internal=True)` (`add_request` returns vLLM's internal id, the given one
plus a random suffix: v1/engine/input_processor.py `assign_request_id`; without internal=True they match no
external id and abort nothing, silently). That
frees their KV blocks at once and leaves `has_unfinished_requests()` false; the model runner drops them from its
persistent batch at the next step's schedule, before the next call's rows are placed. An exception anywhere in
the call aborts its unfinished requests the same way before it propagates, so the next call finds an empty engine
(and refuses to start on one that is not).

In-flight weight updates (trainer.inflight_update=continue, types.WeightUpdates): `updates.poll()` before the first
step and after every step, where no forward runs; a version it applies goes into the model in place (engine.py's
weight-update API) and the running requests go on over the KV blocks the older weights wrote. Each applied version's
marks are the tokens every row held then (its latest report's length; 0 before its first).

Tensor parallel (engine.py, "Placement"): every rank of a group runs the group's rows through its own engine, SPMD,
and samples the same tokens; the rule reads only those outputs (never a clock), so every rank takes the same stop
decision at the same step and the ranks' collectives stay paired.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from hybrid_rl.types import RankGroups, WeightUpdates


@dataclass
class Run:
    """What one call returned: per row vLLM's latest CompletionOutput (None: never scheduled) and whether it
    finished, and what the loop measured. tail_s: wall seconds from the end of the first step after which fewer
    than half of the rows were unfinished to the end of the last step (0 if none, or if that was the last);
    cached_tokens: per row, prompt tokens vLLM's prefix cache served; update_marks: per version `updates` applied,
    the tokens each row held when it took effect (types.WeightUpdates)."""

    outputs: list[Any]
    finished: list[bool]
    tail_s: float
    cached_tokens: list[int]
    update_marks: list[list[int]] = field(default_factory=list)


def require_idle(llm: Any) -> None:
    """Refuse to start a call while vLLM's output processor still tracks a request of an earlier one. Such a request
    would be stepped with this call's (and returned among its results); and once a sleep has aborted it in the
    scheduler only (v1/engine/core.py `pause_scheduler`, mode "abort"), `LLM.generate` would loop forever, its
    `has_unfinished_requests()` never turning false (seen when an abort was left out)."""
    if llm.llm_engine.has_unfinished_requests():
        raise RuntimeError(
            "vLLM still holds requests from an earlier call (an interrupted call must abort its own); "
            "restart the engine"
        )


def run(
    llm: Any,
    prompts: list,
    sampling: list,
    lora_request: Any,
    stop: Optional[RankGroups],
    updates: Optional[WeightUpdates] = None,
) -> Run:
    """Add `prompts` (vLLM TokensPrompts) with their vLLM SamplingParams, step until every request finished or `stop`
    says enough, abort the rest; with `updates`, take weight versions between steps (module docstring). Seeding is
    the caller's (setup.sampling_stream around this call)."""
    engine = llm.llm_engine
    require_idle(llm)
    n = len(prompts)
    outputs: list[Any] = [None] * n
    finished = [False] * n
    cached = [0] * n
    internal: list[str] = []
    row_of: dict[str, int] = {}
    tail_from: Optional[float] = None
    last_step = 0.0
    left = n
    marks: list[list[int]] = []

    def take_updates() -> None:
        for _ in range(updates.poll() if updates is not None else 0):
            marks.append([len(o.token_ids) if o is not None else 0 for o in outputs])

    try:
        take_updates()
        for i, (prompt, sp) in enumerate(zip(llm.renderer.render_cmpl(prompts), sampling)):
            rid = str(next(llm.request_counter))
            row_of[rid] = i
            internal.append(engine.add_request(rid, prompt, sp, lora_request=lora_request))
        done = stop is not None and stop.all_met()
        while not done and engine.has_unfinished_requests():
            newly = False
            for out in engine.step():
                i = row_of.get(out.request_id)
                if i is None:
                    raise RuntimeError(f"vLLM returned request {out.request_id!r}, which this call did not add")
                outputs[i] = out.outputs[0]
                cached[i] = out.num_cached_tokens or 0
                if out.finished and not finished[i]:
                    finished[i], newly, left = True, True, left - 1
                    if stop is not None:
                        stop.finish(i)
            last_step = time.perf_counter()
            if tail_from is None and 2 * left < n:
                tail_from = last_step
            done = newly and stop is not None and stop.all_met()
            if not done:
                take_updates()
    finally:
        unfinished = [rid for i, rid in enumerate(internal) if not finished[i]]
        if unfinished:  # the early stop, or an error: free their KV and leave no request behind
            engine.abort_request(unfinished, internal=True)
    return Run(outputs, finished, 0.0 if tail_from is None else last_step - tail_from, cached, marks)
