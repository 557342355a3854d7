"""What `DecodeGraphs` undoes after a failed CUDA-graph capture, on CPU, against stand-ins that do what
torch 2.13's C++ does (aten/src/ATen/cuda/CUDAGraph.cpp capture_begin / capture_end / pool / reset,
c10/cuda/CUDACachingAllocator.cpp beginAllocateToPool / endAllocateToPool / releasePool and the
`captures_underway.empty()` assertion of empty_cache). A capture that fails must leave no pool in
`captures_underway` (else every later empty_cache raises), must drop exactly the failed graph's hold
on the shared pool (no more: the live graphs still use it), and must put the current stream back.
The real capture runs in tests/gpu/test_native_engine_cuda.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hybrid_rl.rollout.native.decode_graph import DecodeGraphs
from hybrid_rl.rollout.native.kv_cache import StaticKVCache

POOL = (0, 7)  # what graph_pool_handle() returns: only the second value set


class Allocator:
    """The caching allocator's graph-pool bookkeeping."""

    def __init__(self):
        self.underway: list = []  # captures_underway
        self.use: dict = {}  # each private pool's use_count
        self.freeable: set = set()

    def begin(self, pool):  # create_or_incref_pool, then the "already recording" check
        self.use[pool] = self.use.get(pool, 0) + 1
        if pool in self.underway:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.underway.append(pool)

    def end(self, device, pool):
        if pool not in self.underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.underway.remove(pool)

    def release(self, device, pool):
        if pool not in self.use:
            raise RuntimeError("INTERNAL ASSERT FAILED: no such private pool")
        self.use[pool] -= 1
        assert self.use[pool] >= 0, "INTERNAL ASSERT FAILED: uc >= 0"
        if self.use[pool] == 0:
            self.freeable.add(pool)

    def empty_cache(self):
        if self.underway:
            raise RuntimeError("INTERNAL ASSERT FAILED: captures_underway.empty()")
        for pool in self.freeable:
            del self.use[pool]
        self.freeable.clear()


class Graph:
    """CUDAGraph, failing where `fail` says."""

    def __init__(self, alloc: Allocator, fail: str | None = None):
        self.alloc, self.fail, self.ended, self.mempool = alloc, fail, False, None

    def capture_begin(self, pool):
        if self.fail == "begin_checks":  # the TORCH_CHECKs before beginAllocateToPool
            raise RuntimeError("CUDA graphs must be captured on a non-default stream")
        self.mempool = pool
        self.alloc.begin(pool)
        if self.fail == "begin_capture":  # cudaStreamBeginCapture
            raise RuntimeError("CUDA error: operation not permitted")

    def capture_end(self):
        if self.fail in ("host_sync", "end_capture"):  # AT_CUDA_CHECK(cudaStreamEndCapture(...))
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.alloc.end(0, self.mempool)
        if self.fail == "invalid_graph":  # TORCH_CHECK(graph_ != nullptr, "Invalid capture.")
            raise RuntimeError("Invalid capture.")
        self.ended = True

    def pool(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.mempool

    def reset(self):  # the destructor: releases the pool only for a capture that ended
        if self.ended:
            self.alloc.release(0, self.mempool)
            self.ended = False


class Streams:
    def __init__(self):
        self.default = object()
        self.current = self.default
        self.capturing: set = set()

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        yield
        self.current = before

    def set(self, s):
        self.current = s


@pytest.fixture
def fake_cuda(monkeypatch):
    alloc, streams = Allocator(), Streams()

    class graph_ctx:  # torch.cuda.graph: capture stream, then capture_begin; exit: capture_end, then the stream
        def __init__(self, g, pool=None, stream=None):
            self.g, self.pool, self.capture_stream = g, pool, stream

        def __enter__(self):
            streams.current = self.capture_stream
            self.g.capture_begin(self.pool)

        def __exit__(self, *exc):
            self.g.capture_end()
            streams.current = self.before

    def make_ctx(g, pool=None, stream=None):
        ctx = graph_ctx(g, pool, stream)
        ctx.before = streams.current
        return ctx

    monkeypatch.setattr(torch.cuda, "graph", make_ctx)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: POOL)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: streams.current)
    monkeypatch.setattr(torch.cuda, "set_stream", streams.set)
    monkeypatch.setattr(torch.cuda, "stream", streams.stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: streams.current in streams.capturing)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", alloc.end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", alloc.release, raising=False)
    return alloc, streams


def graphs_over(streams: Streams, step) -> DecodeGraphs:
    g = DecodeGraphs(torch.nn.Identity(), StaticKVCache(2, 4), torch.device("cpu"), capture=False, lean=object())
    g.capture, g.capture_stream = True, object()
    g._forward = step
    return g


def host_sync(M):
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


@pytest.mark.parametrize("fail", ["host_sync", "end_capture", "invalid_graph", "begin_capture", "begin_checks"])
@pytest.mark.parametrize("live", [0, 1])
def test_a_failed_capture_leaves_no_capture_underway_and_only_its_own_hold_dropped(fake_cuda, fail, live):
    alloc, streams = fake_cuda
    g = graphs_over(streams, lambda M: torch.zeros(M, 3))
    made = [Graph(alloc) for _ in range(live)]
    for i, good in enumerate(made):  # graph sizes already captured into the shared pool
        g._record(good, 1 << i)
    g._forward = host_sync if fail == "host_sync" else (lambda M: torch.zeros(M, 3))
    bad = Graph(alloc, fail)
    with pytest.raises(RuntimeError):
        g._record(bad, 4)
    assert streams.current is streams.default
    assert alloc.underway == []
    alloc.empty_cache()  # the engine's release, the next capture's graph.__enter__
    assert alloc.use.get(POOL, 0) == live  # the live graphs keep the pool; the failed one holds none
    bad.reset()
    for good in made:
        good.reset()
    alloc.empty_cache()
    assert alloc.use == {}  # the pool is freed with its last graph


def test_a_python_error_in_the_body_leaves_the_ended_capture_to_the_graph(fake_cuda):
    """The body raised but the capture was still valid: capture_end finished, so the graph's reset
    releases the pool and nothing is released twice."""
    alloc, streams = fake_cuda

    def broken(M):
        raise ValueError("a bug in the step")

    g = graphs_over(streams, broken)
    bad = Graph(alloc)
    with pytest.raises(ValueError):
        g._record(bad, 2)
    assert alloc.underway == [] and alloc.use == {POOL: 1} and streams.current is streams.default
    bad.reset()
    alloc.empty_cache()
    assert alloc.use == {}


def test_close_refuses_while_the_capture_stream_still_captures(fake_cuda):
    """The check looks at our capture stream, not at the (restored) current stream."""
    alloc, streams = fake_cuda
    g = graphs_over(streams, host_sync)
    streams.capturing.add(g.capture_stream)
    with pytest.raises(RuntimeError, match="capture is still open"):
        g.close()
    streams.capturing.clear()
    g.close()
    assert g.graphs == {} and g.pool is None
