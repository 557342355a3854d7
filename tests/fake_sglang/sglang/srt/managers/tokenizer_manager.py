"""`Engine.tokenizer_manager` stand-in (`srt/managers/tokenizer_manager.py`, note 10): request states and aborts.

The real TokenizerManager lives in the Engine's process, keeps one state per request id in
flight (`rid_to_state`, created when a generate sends its requests, deleted when a request's
final output arrives) and sends an `AbortReq` to the scheduler for `abort_request`. The
stand-in keeps the states of a streamed generate's requests, and sends the abort to TP rank 0
(the only rank that decodes here; the real rank 0 broadcasts it to the TP group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List


@dataclass
class ReqState:
    abort_sent: bool = False


class TokenizerManager:
    def __init__(self, client):
        self._client = client
        self.rid_to_state: Dict[str, ReqState] = {}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """0.5.21 `TokenizerManager.abort_request`: fire and forget. An empty rid without abort_all is
        ignored (it would prefix-match every request); a rid with no state in flight (finished, or never
        sent) is dropped here (one tokenizer worker); a second abort of one rid is not sent again. The
        scheduler aborts every request of its queues whose rid *starts with* `rid`."""
        if not abort_all and not rid:
            return  # real: a logged warning
        state = None if abort_all else self.rid_to_state.get(rid)
        if not abort_all:
            if state is None or state.abort_sent:
                return
            state.abort_sent = True
        self._client.send_nowait(0, "abort", {"rid": rid, "abort_all": abort_all})

    # -- the stand-in Engine's bookkeeping (the real one does this in generate_request) ------------
    def add(self, rids: List[str]) -> None:
        """_init_req_state: a rid already in flight is refused before anything is sent."""
        for rid in rids:
            if rid in self.rid_to_state:
                raise ValueError(f"Duplicate request ID detected: {rid}")
        for rid in rids:
            self.rid_to_state[rid] = ReqState()

    def finish(self, rid: str) -> None:
        self.rid_to_state.pop(rid, None)

    def finish_all(self, rids: List[str]) -> None:
        for rid in rids:
            self.rid_to_state.pop(rid, None)
