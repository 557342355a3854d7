"""The native engine's decode step replayed as CUDA graphs, one per graph size (live rows padded to a power of two).

A decode step of a small batch is mostly kernel-launch latency: one token through
every layer is hundreds of small kernels. Capturing the step once per batch size and
replaying it removes the Python and launch cost. This needs fixed shapes and
addresses, so the step reads a full-length `StaticKVCache` (all S slots, masked
with a boolean mask the engine keeps), and its inputs are copied into buffers
owned here.

The captured step is always the engine's `LeanStep`; a model without one is never
captured (`decode_path.py`). The lean step calls the layers' parts directly, so it runs
none of the module hooks: under FSDP2 the root module's pre-forward hook makes the
all-gather streams wait on the current stream, which inside a capture would fork the
captured stream onto streams that never rejoin it, so capturing the model's forward
fails on every batch.

Each graph size is captured the first time it is used, after one eager run of the same
step (the warm-up the capture needs, on the capture stream), and the replay is checked
against that eager result once; any failure raises out of the token loop
(`decode_path.GraphStep` calls `close()` first), and the engine decodes that batch again,
eagerly, from its prefill.

Every warm-up and capture of the process runs on one stream per device (`capture_stream`). cuBLAS keeps a
workspace per (handle, stream) it has run a matmul on, for the life of the process, allocated through torch's
caching allocator (aten/src/ATen/cuda/CublasHandlePool.cpp, `setWorkspaceForHandle` and
`getCUDABlasLtWorkspace`: 32 MiB on Hopper, plus 1 MiB for cuBLASLt): a fresh `torch.cuda.Stream()` per engine
or per graph size (torch's pool hands out 32 in turn) leaves up to 32 of them behind, and a workspace first
made inside a capture lands in the graphs' pool and pins it. Warmed up on the capture stream itself, the
workspace exists before the capture, outside any pool, and is made once.

A failed capture is cleaned up here (`_abandon`), because torch leaves things behind when `capture_end` raises
at `cudaStreamEndCapture` (an invalidated capture: a host sync in the body). capture_begin
(aten/src/ATen/cuda/CUDAGraph.cpp; torch 2.11 checked against its binary) opens the pool's recording in two
allocators, in this order: the caching allocator's `beginAllocateToPool` (one more holder of the pool, the
capture in `captures_underway`), then (in 2.11, not in the older CUDAGraph.cpp this was first written from)
the pinned host allocator's `begin_allocate_to_pool` (the same two things in its own tables, with the same
"already recording to mempool_id" check), then `cudaStreamBeginCapture`. capture_end ends both recordings only
after `cudaStreamEndCapture` succeeded, and marks the capture ended (the graph's reset then releases its
holds) only after that. So when it raises: `graph.__exit__` skips restoring the current stream; the device
allocator keeps the pool in `captures_underway` for good, and every later `torch.cuda.empty_cache()` fails its
`captures_underway.empty()` assertion (the engine's release, the next capture's `graph.__enter__`), an OOM
retry frees no cached blocks; and the host allocator keeps the pool id recording, so the next capture into
that id fails in capture_begin ("beginAllocateToPool: already recording to mempool_id"). After a failure the
stream is put back and the device allocator's recording ended and the failed graph's hold dropped
(`torch._C._cuda_endAllocateToPool` / `_cuda_releasePool`); torch exposes no call to end the host allocator's,
so the pool id is never captured into again: the next capture takes a fresh `graph_pool_handle` (right on a
torch without the host recording too). The stale host entry costs a capture-status query per pinned
allocation; its filter compares capture ids only for a stream that is capturing, and a capture's id is never
reused, so it routes nothing to the dead pool. The pool is ours (`graph_pool_handle`, shared by every graph
size, all captured on our one stream). `close()` drops every graph (the pool's last holders) and refuses to go
on if our capture stream still captures. Imported only when graphs are asked for.

Legend: N rows allocated, M rows live (a graph size: `decode_loop.graph_size`), S cache slots, V vocab.
"""

from __future__ import annotations

import time

import torch

from hybrid_rl.rollout.native.kv_cache import StaticKVCache
from hybrid_rl.rollout.native.lean_step import LeanStep

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's one stream for every graph warm-up and capture on `device` (module docstring: cuBLAS
    keeps a workspace for each stream it has run on)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return _CAPTURE_STREAMS[index]


class DecodeGraphs:
    """Captures and replays `model`'s one-token forward over `cache` for each graph size M (the live rows, padded)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StaticKVCache,
        device: torch.device,
        capture: bool = True,
        lean: LeanStep | None = None,
    ):
        """capture=False runs the same fixed-shape step eagerly, on any device (tests of the
        graph path's full-length cache, masks and graph sizes on CPU). lean: the step to
        capture, required (the model's forward is never captured)."""
        if capture and device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the model is on {device}")
        if lean is None:
            raise ValueError("DecodeGraphs captures the lean decode step only; this model has none (decode eagerly)")
        N, S = cache.max_rows, cache.max_len
        self.model, self.cache, self.lean = model, cache, lean
        self.ids_N1 = torch.zeros((N, 1), dtype=torch.long, device=device)
        self.pos_N1 = torch.zeros((N, 1), dtype=torch.long, device=device)
        self.mask_NS = torch.zeros((N, S), dtype=torch.bool, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by every graph size's graph (made at the first capture)
        self.capture = capture
        self.capture_stream = capture_stream(device) if capture else None  # every warm-up's and capture's
        self.capture_s = 0.0  # host seconds spent capturing (warm-up, capture, check), all graph sizes

    def step(self, ids_M1: torch.Tensor, pos_M1: torch.Tensor, mask_MS: torch.Tensor) -> torch.Tensor:
        """logits_MV of the next token. The result is a graph output: read it before the next step."""
        M = ids_M1.shape[0]
        self.ids_N1[:M].copy_(ids_M1)
        self.pos_N1[:M].copy_(pos_M1)
        self.mask_NS[:M].copy_(mask_MS)
        self.cache.sync_write_slot()
        if not self.capture:
            return self._forward(M)
        if M not in self.graphs:
            return self._capture(M)
        graph, logits_MV = self.graphs[M]
        graph.replay()
        return logits_MV

    def _forward(self, M: int) -> torch.Tensor:
        return self.lean(self.ids_N1[:M], self.pos_N1[:M], self.mask_NS[:M], self.cache)

    def close(self) -> None:
        """Drop every graph (they hold the shared private pool; it is freed with the last) after a failure.

        Raises if our capture stream still captures: eager decoding, and the engine's
        empty_cache() at release, must not run beside an abandoned capture."""
        self.graphs.clear()
        self.pool = None
        if self.capture_stream is not None:
            with torch.cuda.stream(self.capture_stream):
                capturing = torch.cuda.is_current_stream_capturing()
            if capturing:
                raise RuntimeError(
                    "a CUDA-graph capture is still open after a failed decode step; the process "
                    "cannot safely allocate memory: restart it with the engine's cuda_graphs=False"
                )

    def _capture(self, M: int) -> torch.Tensor:
        t0 = time.perf_counter()
        stream = self.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the warm-up on the capture stream: its cuBLAS workspace, made here
            # Writes the same keys and values to the same slot as the replay below will.
            eager_MV = self._forward(M).clone()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        logits_MV = self._record(graph, M)
        graph.replay()
        # One host sync per graph size: a capture that recorded the wrong thing (a hook that
        # ran only at capture time, a stale address) must not decode silently. In the logits' dtype: the
        # difference of two close values is exact there (Sterbenz), and fp32 copies would hold 3 (M, V)
        # fp32 tensors at once, more than the rollout bill's decode terms leave (plan/rollout_memory.py).
        err = (logits_MV - eager_MV).abs_().max().float()
        if not bool(err <= 1e-3 * (1.0 + eager_MV.abs().max().float())):
            raise RuntimeError(f"CUDA graph replay differs from the eager step by {float(err):.3g}")
        self.graphs[M] = (graph, logits_MV)
        self.capture_s += time.perf_counter() - t0  # the check above synchronised: the capture is done
        return logits_MV

    def _record(self, graph: torch.cuda.CUDAGraph, M: int) -> torch.Tensor:
        """The step of M rows captured into `graph`, in the shared pool; on failure, `_abandon` first."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream, device = torch.cuda.current_stream(), torch.cuda.current_device()
        began = False
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                began = True  # capture_begin returned: the pool holds a count for this graph
                return self._forward(M)
        except BaseException:
            self._abandon(graph, began, stream, device)
            raise

    def _abandon(self, graph: torch.cuda.CUDAGraph, began: bool, stream: torch.cuda.Stream, device: int) -> None:
        """Undo what a failed capture leaves behind (module docstring; aten CUDAGraph.cpp capture_begin /
        capture_end / reset).

        A capture that ended needs nothing: both allocators' recordings are over and the graph's reset
        releases its holds. Otherwise the device allocator's recording is ended here (unless capture_end got
        past that before failing) and the graph's hold released; a capture_begin that failed before joining
        (endAllocateToPool then says the pool is not recording) holds nothing to release. Either way the
        pool id is dropped: the host allocator may still be recording to it, with no call to end that."""
        torch.cuda.set_stream(stream)  # graph.__exit__ skips this when capture_end raises
        if began and _capture_ended(graph):
            return
        pool, self.pool = self.pool, None  # the next capture takes a fresh pool (graphs made keep theirs)
        try:
            torch._C._cuda_endAllocateToPool(device, pool)
        except RuntimeError:
            if not began:
                return
        torch._C._cuda_releasePool(device, pool)


def _capture_ended(graph: torch.cuda.CUDAGraph) -> bool:
    """Whether capture_end finished (CUDAGraph.pool() refuses a graph whose capture did not)."""
    try:
        graph.pool()
    except RuntimeError:
        return False
    return True
