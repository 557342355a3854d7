"""Finished groups, rollout rank -> learner rank, as one packed tensor over the process group.

Why one int64 tensor and not pickled objects: a send is then two messages (a fixed header with the
payload length, then the payload) that gloo moves on CPU and NCCL could move on GPU, with no pickle
on the hot path and a format a test can pin. Floats travel as their float64 bits (`view(int64)`), so
engine log-probs, rewards and scores arrive bit-exact: the learner's correction and advantages see
exactly what the rollout rank computed.

Layout (all int64):
    header   [MAGIC, FORMAT, payload length, n groups]
    payload  groups  (n x 4): row index, start version, prompt length, completions
             seqs    (N x 2): completion length, finish reason code
             prompt ids, completion ids, per-token versions (one per completion token)
             float64 bits: engine log-probs (one per completion token), rewards (N), scores (N)

A peer that died fails the wait at once ("Connection closed by peer"); one that hangs fails it after
`timeout_s`. Either way the error names the peer's role and global rank.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from hybrid_rl.split.staleness import VersionedGroup
from hybrid_rl.types import Completion

MAGIC = 0x5EED_6A0B
FORMAT = 1
HEADER_LEN = 4
FINISH_REASONS = ("stop", "length", "abort")  # abort: a partial rollout cut by a checkpoint or shutdown


class PeerError(RuntimeError):
    """The peer of a send or receive died or did not answer within the timeout."""


def _floats(values: Sequence[float]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float64).view(torch.int64)


def _finish_code(reason: str) -> int:
    if reason not in FINISH_REASONS:
        raise ValueError(f"finish reason {reason!r} cannot be sent; known: {list(FINISH_REASONS)}")
    return FINISH_REASONS.index(reason)


def pack_groups(groups: Sequence[VersionedGroup]) -> torch.Tensor:
    """The payload (module docstring) of `groups`, in order."""
    table, seqs, prompts, comps, versions, logps, rewards, scores = [], [], [], [], [], [], [], []
    for g in groups:
        table += [g.row_index, g.version, len(g.prompt_ids), len(g.completions)]
        prompts += g.prompt_ids
        for i, c in enumerate(g.completions):
            if len(c.logprobs) != len(c.token_ids):
                raise ValueError(
                    f"group of row {g.row_index}, completion {i}: {len(c.token_ids)} tokens but "
                    f"{len(c.logprobs)} log-probs"
                )
            seqs += [len(c.token_ids), _finish_code(c.finish_reason)]
            comps += c.token_ids
            versions += g.versions_of(i)
            logps += c.logprobs
        rewards += g.rewards
        scores += g.scores
    ints = torch.tensor(table + seqs + prompts + comps + versions, dtype=torch.int64)
    return torch.cat([ints, _floats(logps), _floats(rewards), _floats(scores)])


class _Reader:
    """Consumes the payload front to back."""

    def __init__(self, payload: torch.Tensor):
        self.data, self.pos = payload, 0

    def ints(self, n: int) -> list[int]:
        out = self.data[self.pos : self.pos + n]
        if out.numel() != n:
            raise ValueError(f"payload ends at {self.data.numel()} elements, {n} more expected at {self.pos}: corrupt")
        self.pos += n
        return out.tolist()

    def floats(self, n: int) -> list[float]:
        start = self.pos
        self.ints(n)
        return self.data[start : self.pos].view(torch.float64).tolist()


def unpack_groups(payload: torch.Tensor, n_groups: int) -> list[VersionedGroup]:
    """The inverse of `pack_groups`; token versions all equal to the start version come back as None."""
    rd = _Reader(payload)
    table = [rd.ints(4) for _ in range(n_groups)]
    seqs = [rd.ints(2) for _ in range(sum(t[3] for t in table))]
    prompts = rd.ints(sum(t[2] for t in table))
    n_tok = sum(s[0] for s in seqs)
    comps, versions = rd.ints(n_tok), rd.ints(n_tok)
    logps, rewards, scores = rd.floats(n_tok), rd.floats(len(seqs)), rd.floats(len(seqs))
    if rd.pos != payload.numel():
        raise ValueError(f"payload has {payload.numel() - rd.pos} elements past its groups: corrupt")
    out, p, s, t = [], 0, 0, 0
    for row, version, plen, n in table:
        completions, tv = [], []
        for length, code in seqs[s : s + n]:
            completions.append(Completion(comps[t : t + length], logps[t : t + length], FINISH_REASONS[code]))
            tv.append(versions[t : t + length])
            t += length
        partial = any(v != version for vs in tv for v in vs)
        out.append(
            VersionedGroup(
                row,
                prompts[p : p + plen],
                completions,
                rewards[s : s + n],
                scores[s : s + n],
                version,
                tv if partial else None,
            )
        )
        p, s = p + plen, s + n
    return out


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError, NCCL DistBackendError
        raise PeerError(
            f"split transport: {what} failed within {timeout_s:g} s: the peer died or hangs "
            f"({type(err).__name__}: {str(err).strip().splitlines()[0][:200]})"
        ) from err


def send_groups(groups: Sequence[VersionedGroup], dst: int, timeout_s: float, group=None, peer: str = "") -> int:
    """Send `groups` to global rank `dst`; returns the bytes sent (header + payload)."""
    payload = pack_groups(groups)
    _send(MAGIC, payload, len(groups), dst, timeout_s, group, f"{len(groups)} groups to {peer or f'rank {dst}'}")
    return (HEADER_LEN + payload.numel()) * 8


def recv_groups(src: int, timeout_s: float, group=None, peer: str = "") -> tuple[list[VersionedGroup], int]:
    """Receive one `send_groups` from global rank `src`: (groups, bytes received)."""
    payload, n_groups = _recv(MAGIC, "a group message", src, timeout_s, group, f"groups from {peer or f'rank {src}'}")
    return unpack_groups(payload, n_groups), (HEADER_LEN + payload.numel()) * 8


JSON_MAGIC = 0x5EED_0150


def send_json(obj, dst: int, timeout_s: float, group=None, peer: str = "") -> None:
    """Send a JSON-safe object (a batch's metrics, loader position and timings) to global rank `dst`: the UTF-8
    bytes as int64s after a JSON_MAGIC header."""
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(torch.int64)
    _send(JSON_MAGIC, payload, 0, dst, timeout_s, group, f"a batch's metrics to {peer or f'rank {dst}'}")


def recv_json(src: int, timeout_s: float, group=None, peer: str = ""):
    """Receive one `send_json` from global rank `src`."""
    payload, _ = _recv(
        JSON_MAGIC, "a metrics message", src, timeout_s, group, f"a batch's metrics from {peer or f'rank {src}'}"
    )
    return json.loads(payload.to(torch.uint8).numpy().tobytes().decode())


def _send(magic: int, payload: torch.Tensor, count: int, dst: int, timeout_s: float, group, what: str) -> None:
    """A header [magic, FORMAT, payload length, count], then the int64 payload."""
    header = torch.tensor([magic, FORMAT, payload.numel(), count], dtype=torch.int64)
    _wait(dist.isend(header, dst=dst, group=group), timeout_s, f"sending {what}")
    _wait(dist.isend(payload, dst=dst, group=group), timeout_s, f"sending {what}")


def _recv(magic: int, kind: str, src: int, timeout_s: float, group, what: str) -> tuple[torch.Tensor, int]:
    """(payload, count) of one `_send` from `src`; a header of another kind is a protocol disagreement."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    _wait(dist.irecv(header, src=src, group=group), timeout_s, f"receiving {what}")
    got_magic, fmt, length, count = header.tolist()
    if got_magic != magic or fmt != FORMAT:
        raise PeerError(
            f"split transport: the header {header.tolist()} received ({what}) is not {kind} "
            f"(format {FORMAT}): the ranks disagree on the protocol"
        )
    payload = torch.empty(length, dtype=torch.int64)
    _wait(dist.irecv(payload, src=src, group=group), timeout_s, f"receiving {what}")
    return payload, count
