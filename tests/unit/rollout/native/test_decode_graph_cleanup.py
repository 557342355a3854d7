"""What `DecodeGraphs` undoes after a failed CUDA-graph capture, on CPU, against stand-ins that do what
torch's C++ does (aten/src/ATen/cuda/CUDAGraph.cpp capture_begin / capture_end / pool / reset,
c10/cuda/CUDACachingAllocator.cpp beginAllocateToPool / endAllocateToPool / releasePool and the
`captures_underway.empty()` assertion of empty_cache; in torch 2.11 also the pinned host allocator's
begin_allocate_to_pool / end_allocate_to_pool / release_pool, ATen/core/CachingHostAllocator.h, which
capture_begin calls after the device allocator's and capture_end after it, with no Python binding to end
it: `fake_cuda` runs every test both with it, "2.11", and without it, "older"). A capture that fails must
leave no pool in the device allocator's `captures_underway` (else every later empty_cache raises), must
drop exactly the failed graph's hold on the shared pool (no more: the live graphs still use it), must put
the current stream back, and must leave the next capture working (a pool id the host allocator still
records to is never captured into again). The real capture runs in tests/gpu/test_native_engine_cuda.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hybrid_rl.rollout.native import decode_graph
from hybrid_rl.rollout.native.decode_graph import DecodeGraphs
from hybrid_rl.rollout.native.kv_cache import StaticKVCache

POOL = (0, 7)  # what the first graph_pool_handle() returns: only the second value set; then (0, 8), ...


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
    """CUDAGraph, failing where `fail` says; `host`: the pinned host allocator's tables (torch 2.11), or None."""

    def __init__(self, alloc: Allocator, fail: str | None = None, host: Allocator | None = None):
        self.alloc, self.fail, self.host, self.ended, self.mempool = alloc, fail, host, False, None

    def capture_begin(self, pool):
        if self.fail == "begin_checks":  # the TORCH_CHECKs before beginAllocateToPool
            raise RuntimeError("CUDA graphs must be captured on a non-default stream")
        self.mempool = pool
        self.alloc.begin(pool)
        if self.host is not None:
            self.host.begin(pool)  # begin_allocate_to_pool: the same incref, then the same check
        if self.fail == "begin_capture":  # cudaStreamBeginCapture
            raise RuntimeError("CUDA error: operation not permitted")

    def capture_end(self):
        if self.fail in ("host_sync", "end_capture"):  # AT_CUDA_CHECK(cudaStreamEndCapture(...))
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.alloc.end(0, self.mempool)
        if self.host is not None:
            self.host.end(0, self.mempool)
        if self.fail == "invalid_graph":  # TORCH_CHECK(graph_ != nullptr, "Invalid capture.")
            raise RuntimeError("Invalid capture.")
        self.ended = True

    def pool(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.mempool

    def replay(self):
        pass

    def reset(self):  # the destructor: releases the pool only for a capture that ended
        if self.ended:
            self.alloc.release(0, self.mempool)
            if self.host is not None:
                self.host.release(0, self.mempool)
            self.ended = False


class Stream:
    def wait_stream(self, other):
        pass


class Streams:
    def __init__(self):
        self.default = Stream()
        self.current = self.default
        self.capturing: set = set()

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        yield
        self.current = before

    def set(self, s):
        self.current = s


class Fake:
    """The fixture's torch: the device allocator, the host allocator (None: a torch without its recording)."""

    def __init__(self, host: bool):
        self.alloc, self.host, self.streams = Allocator(), Allocator() if host else None, Streams()

    def graph(self, fail: str | None = None) -> Graph:
        return Graph(self.alloc, fail, self.host)


@pytest.fixture(params=["2.11", "older"])
def fake_cuda(monkeypatch, request):
    fake = Fake(host=request.param == "2.11")
    alloc, streams = fake.alloc, fake.streams
    handles = iter(range(POOL[1], POOL[1] + 100))

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
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: streams.current)
    monkeypatch.setattr(torch.cuda, "set_stream", streams.set)
    monkeypatch.setattr(torch.cuda, "stream", streams.stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: streams.current in streams.capturing)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", fake.graph)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", alloc.end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", alloc.release, raising=False)
    return fake


def graphs_over(step) -> DecodeGraphs:
    g = DecodeGraphs(torch.nn.Identity(), StaticKVCache(2, 4), torch.device("cpu"), capture=False, lean=object())
    g.capture, g.capture_stream = True, Stream()
    g._forward = step
    return g


def host_sync(M):
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


FAILS = ["host_sync", "end_capture", "invalid_graph", "begin_capture", "begin_checks"]


@pytest.mark.parametrize("fail", FAILS)
@pytest.mark.parametrize("live", [0, 1])
def test_a_failed_capture_leaves_no_capture_underway_and_only_its_own_hold_dropped(fake_cuda, fail, live):
    alloc, streams = fake_cuda.alloc, fake_cuda.streams
    g = graphs_over(lambda M: torch.zeros(M, 3))
    made = [fake_cuda.graph() for _ in range(live)]
    for i, good in enumerate(made):  # graph sizes already captured into the shared pool
        g._record(good, 1 << i)
    g._forward = host_sync if fail == "host_sync" else (lambda M: torch.zeros(M, 3))
    bad = fake_cuda.graph(fail)
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


@pytest.mark.parametrize("fail", FAILS)
def test_the_next_capture_works_after_a_failed_one(fake_cuda, fail):
    """Catches: capturing again into the pool id of a capture that did not end. Under torch 2.11 the pinned host
    allocator still records to that id (capture_end raised before ending it, and torch has no call to end it), so
    capture_begin refused every later capture of the engine ("beginAllocateToPool: already recording to
    mempool_id", seen on an H200): the next capture must take a fresh pool; one that ended keeps its pool."""
    g = graphs_over(lambda M: torch.zeros(M, 3))
    g._forward = host_sync if fail == "host_sync" else (lambda M: torch.zeros(M, 3))
    with pytest.raises(RuntimeError):
        g._record(fake_cuda.graph(fail), 4)
    g._forward = lambda M: torch.zeros(M, 3)
    again = fake_cuda.graph()
    g._record(again, 4)
    assert again.ended and again.pool() != POOL and fake_cuda.alloc.underway == []
    g._record(fake_cuda.graph(), 2)  # a capture that ended leaves its pool to the next graph size
    assert g.pool == again.pool()


def test_a_python_error_in_the_body_leaves_the_ended_capture_to_the_graph(fake_cuda):
    """The body raised but the capture was still valid: capture_end finished, so the graph's reset
    releases the pool and nothing is released twice."""
    alloc = fake_cuda.alloc

    def broken(M):
        raise ValueError("a bug in the step")

    g = graphs_over(broken)
    bad = fake_cuda.graph()
    with pytest.raises(ValueError):
        g._record(bad, 2)
    assert alloc.underway == [] and alloc.use == {POOL: 1} and fake_cuda.streams.current is fake_cuda.streams.default
    assert fake_cuda.host is None or (fake_cuda.host.underway == [] and fake_cuda.host.use == {POOL: 1})
    bad.reset()
    alloc.empty_cache()
    assert alloc.use == {}


def test_failures_of_both_kinds_in_turn_leave_captures_working(fake_cuda):
    """The sequence tests/gpu/test_native_engine_cuda.py runs on the GPU: a bug in the body (the capture still
    ends), a host sync (it does not), then the bug again: each raises its own error, never torch's refusal to
    begin a capture, and after each the stream is back and empty_cache works."""
    g = graphs_over(lambda M: torch.zeros(M, 3))

    def bug(M):
        raise ValueError("a bug in the step")

    for broken, err in ((bug, ValueError), (host_sync, RuntimeError), (bug, ValueError)):
        g._forward = broken
        graph = fake_cuda.graph("host_sync" if broken is host_sync else None)
        with pytest.raises(err) as caught:
            g._record(graph, 2)
        assert "already recording" not in str(caught.value)
        assert fake_cuda.streams.current is fake_cuda.streams.default
        graph.reset()  # the graph object dies
        fake_cuda.alloc.empty_cache()
    g.close()
    assert fake_cuda.alloc.use == {}


def test_the_warm_up_and_the_capture_run_on_the_one_capture_stream(fake_cuda, monkeypatch):
    """Catches: a warm-up on a stream of its own (a fresh one per graph size before). cuBLAS keeps a workspace
    (32 MiB on Hopper, + 1 MiB for cuBLASLt) for every stream it ran a matmul on, for the life of the process:
    fresh streams, handed out in turn from torch's pool of 32, left up to 32 of them (the H200 run found 33 MiB
    left after a failed capture), and a workspace first made inside the capture pinned the graphs' pool. One
    stream per device for every DecodeGraphs, warmed up before its capture, makes one, outside any pool."""
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: made.append(Stream()) or made[-1])
    monkeypatch.setattr(decode_graph, "_CAPTURE_STREAMS", {})
    one = decode_graph.capture_stream(torch.device("cuda", 0))
    assert decode_graph.capture_stream(torch.device("cuda")) is one and made == [one]
    assert decode_graph.capture_stream(torch.device("cuda", 1)) is not one
    seen = []
    g = graphs_over(lambda M: seen.append(fake_cuda.streams.current) or torch.ones(M, 3))
    g.capture_stream = one
    g.cache.set_full_length(True, torch.device("cpu"))
    ids = torch.zeros(2, 1, dtype=torch.long)
    g.step(ids, ids, torch.ones(2, 4, dtype=torch.bool))
    assert seen == [one, one]  # the warm-up, then the capture
    assert fake_cuda.streams.current is fake_cuda.streams.default and 2 in g.graphs


def test_close_refuses_while_the_capture_stream_still_captures(fake_cuda):
    """The check looks at our capture stream, not at the (restored) current stream."""
    streams = fake_cuda.streams
    g = graphs_over(host_sync)
    streams.capturing.add(g.capture_stream)
    with pytest.raises(RuntimeError, match="capture is still open"):
        g.close()
    streams.capturing.clear()
    g.close()
    assert g.graphs == {} and g.pool is None
