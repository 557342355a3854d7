"""Every tensor collective helper refuses, with a clear error, a tensor whose device the
process group cannot serve (a host metric on a plain nccl group), before it reaches torch."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.runtime import distributed as D

HELPERS = {
    "all_reduce_sum": lambda x: D.all_reduce_sum(x),
    "all_reduce_max": lambda x: D.all_reduce_max(x),
    "broadcast_tensor_": lambda x: D.broadcast_tensor_(x, src=0),
}


@pytest.fixture
def fake_group(monkeypatch):
    """A 'group' that serves what the test says, and records the collectives torch would run."""
    calls: list[str] = []
    monkeypatch.setattr(D, "is_dist", lambda: True)
    monkeypatch.setattr(D.dist, "get_backend_config", lambda: "nccl")
    for name in ("all_reduce", "broadcast"):
        monkeypatch.setattr(D.dist, name, lambda *a, _n=name, **k: calls.append(_n))

    def serve(types: set[str]) -> list[str]:
        monkeypatch.setattr(D, "_served", lambda: types)
        return calls

    return serve


@pytest.mark.parametrize("name", sorted(HELPERS))
def test_a_host_tensor_on_a_cuda_only_group_is_refused(fake_group, name) -> None:
    calls = fake_group({"cuda"})
    with pytest.raises(RuntimeError, match=r"got a cpu tensor .* serves only \['cuda'\].*cpu:gloo,cuda:nccl"):
        HELPERS[name](torch.ones(2))
    assert calls == [], "refused before the collective runs"


@pytest.mark.parametrize("name", sorted(HELPERS))
def test_a_served_tensor_goes_through(fake_group, name) -> None:
    calls = fake_group({"cpu", "cuda"})
    HELPERS[name](torch.ones(2))
    assert len(calls) == 1
