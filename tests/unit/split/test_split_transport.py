"""The packed group format of the split transport (hybrid_rl/split/transport.py) without a process group:
round trip bit-exact, corrupt payloads and unknown finish reasons refused. The 2-rank send/receive is
tests/distributed/test_split_ranks.py."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.split.staleness import VersionedGroup
from hybrid_rl.split.transport import pack_groups, unpack_groups
from hybrid_rl.types import Completion


def _groups() -> list[VersionedGroup]:
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(6, generator=g, dtype=torch.float64).tolist()  # full float64 mantissas must survive
    a = VersionedGroup(
        3,
        [2, 9],
        [Completion([4, 5, 1], lp[:3], "stop"), Completion([6], lp[3:4], "length")],
        [1.0, 1 / 3],
        [0.25, -2 / 7],
        version=2,
    )
    b = VersionedGroup(
        8,
        [2],
        [Completion([7, 7], lp[4:6], "abort"), Completion([], [], "stop")],
        [0.0, 0.1],
        [0.0, 0.2],
        version=4,
        token_versions=[[4, 5], []],
    )
    return [a, b]


def test_round_trip_is_bit_exact():
    groups = _groups()
    payload = pack_groups(groups)
    assert payload.dtype == torch.int64 and payload.dim() == 1
    back = unpack_groups(payload, len(groups))
    assert back == groups
    assert back[1].token_versions == [[4, 5], []] and back[0].token_versions is None


def test_corrupt_payloads_are_refused():
    payload = pack_groups(_groups())
    with pytest.raises(ValueError, match="corrupt"):
        unpack_groups(payload[:-1], 2)
    with pytest.raises(ValueError, match="past its groups"):
        unpack_groups(torch.cat([payload, payload[:1]]), 2)


def test_unknown_finish_reason_and_mismatched_logprobs_are_refused():
    bad = VersionedGroup(0, [2], [Completion([4], [0.0], "eos")], [0.0], [0.0], 0)
    with pytest.raises(ValueError, match="finish reason 'eos'"):
        pack_groups([bad])
    short = VersionedGroup(0, [2], [Completion([4, 5], [0.0], "stop")], [0.0], [0.0], 0)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        pack_groups([short])
