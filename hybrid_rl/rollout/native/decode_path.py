"""How the native engine decodes, decided in one place: CUDA graphs, the lean step, or the model's forward
(and which mask that forward gets), each path's step function, and the device memory a rollout may plan with.

The engine chooses the path once per rollout (`choose_decode_path`) and builds that path's step
(`ForwardStep`, `LeanDecodeStep`, `GraphStep`) once per batch, over the batch's cache; the token
loop calls only that step. Nothing inside the loop picks a path, falls back or retries: a CUDA
graph that fails raises `GraphDecodeFailed` out of the loop, and the engine decodes that batch
again from its prefill through the lean step (and the rest of its rollouts, graphs off for good),
so every completion comes from one path.

CUDA graphs capture only the lean step (`lean_step.py`). The generic Hugging Face forward
is never captured: under FSDP2 its module hooks make the all-gather streams wait on the
capturing stream, so the capture fails on every batch, and a failed capture is not free
(torch's `graph.__exit__` skips restoring the current stream when `capture_end` raises, and
leaves the pool recorded as capturing in both allocators: `decode_graph.py` puts the stream back, ends the
device allocator's recording and never captures into that pool again). Where the model has no
lean step the engine decodes eagerly and says why once; a user who asked for graphs explicitly gets an error.

The forward path hands the model a ready 4-D (M, 1, 1, S) boolean mask only where the
attention implementation takes one (sdpa, eager) and every layer is full attention;
flash-attention (and any other implementation) gets the 2-D padding mask and transformers'
own mask builder, which is what flash-attention's varlen path reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

MASK_4D_IMPLEMENTATIONS = ("sdpa", "eager")  # attention functions that accept a ready boolean 4-D mask


@dataclass(frozen=True)
class DecodePath:
    name: str  # "cuda_graph" (the lean step, captured), "lean" (eager) or "forward" (the model's forward)
    mask_4d: bool  # forward path only: pass attn_NS[:, None, None, :] instead of the 2-D mask
    note: Optional[str] = None  # why graphs are off where they would have been used (to log once)


def base_attention(implementation: str) -> str:
    """The attention implementation under the shared-prefix wrapper's name
    ('hybrid_rl_shared_prefix+sdpa' -> 'sdpa')."""
    return implementation.rsplit("+", 1)[-1]


def check_graph_request(cuda_graphs: Optional[bool], lean_step: Optional[bool], lean_reason: Optional[str]) -> None:
    """Refuse cuda_graphs=True where no lean step will run: the generic forward is never captured."""
    if not cuda_graphs:
        return
    if lean_step is False:
        raise ValueError(
            "cuda_graphs=True needs the lean decode step, and lean_step=False turns it off; "
            "set lean_step=None (or True), or cuda_graphs=None"
        )
    if lean_reason is not None:
        raise ValueError(
            f"cuda_graphs=True needs the lean decode step, which this model lacks ({lean_reason}); "
            "the Hugging Face forward is not captured (under FSDP2 the capture fails on every batch). "
            "Set cuda_graphs=None (decode eagerly, said once) or False"
        )


def choose_decode_path(
    device_type: str,
    cuda_graphs: Optional[bool],
    lean_step: Optional[bool],
    lean_reason: Optional[str],
    full_attention: bool,
    attn_implementation: str,
) -> DecodePath:
    """The decode path for a model on `device_type`.

    cuda_graphs / lean_step: the engine's flags (None = where possible). lean_reason: why the
    lean step cannot run the model (None: it can). Raises ValueError for cuda_graphs=True
    without a lean step; cuda_graphs=True off CUDA is the caller's warning (a CPU test
    may ask for it), and decodes without graphs.
    """
    check_graph_request(cuda_graphs, lean_step, lean_reason)
    lean = lean_step is not False and lean_reason is None
    mask_4d = full_attention and base_attention(attn_implementation) in MASK_4D_IMPLEMENTATIONS
    if lean and device_type == "cuda" and cuda_graphs is not False:
        return DecodePath("cuda_graph", mask_4d)
    note = None
    if device_type == "cuda" and cuda_graphs is None and not lean:
        why = "lean_step=False" if lean_step is False else lean_reason
        note = (
            f"CUDA graphs off: they capture only the lean decode step, which does not run here ({why}); "
            "decoding with the model's forward, eagerly"
        )
    return DecodePath("lean" if lean else "forward", mask_4d, note)


class GraphDecodeFailed(RuntimeError):
    """A CUDA graph's capture or replay failed during a batch (its graphs are already dropped)."""


class ForwardStep:
    """One token through the model's own forward (any model): logits_MV from ids_M1, pos_M1 and the
    attention mask attn_MS over all S slots, of which the first P + t + 1 are read at token t."""

    fixed_shape = False  # the live batch shrinks to exactly the unfinished rows
    capture_s = 0.0

    def __init__(self, model: Any, cache: Any, P: int, mask_4d: bool):
        self.model, self.cache, self.P, self.mask_4d = model, cache, P, mask_4d

    def __call__(self, ids_M1, pos_M1, attn_MS, t: int):
        live_MS = attn_MS[:, : self.P + t + 1]
        # Only sdpa and eager take a ready 4-D mask; flash-attention gets the 2-D one (module docstring).
        mask = live_MS[:, None, None, :] if self.mask_4d else live_MS
        return self.model(
            input_ids=ids_M1, attention_mask=mask, position_ids=pos_M1, past_key_values=self.cache, use_cache=True
        ).logits[:, -1]


class LeanDecodeStep:
    """One token through the lean step (`lean_step.LeanStep`), eagerly; same arguments as `ForwardStep`."""

    fixed_shape = False
    capture_s = 0.0

    def __init__(self, lean: Any, cache: Any, P: int):
        self.lean, self.cache, self.P = lean, cache, P

    def __call__(self, ids_M1, pos_M1, attn_MS, t: int):
        return self.lean(ids_M1, pos_M1, attn_MS[:, : self.P + t + 1], self.cache)


class GraphStep:
    """One token through `decode_graph.DecodeGraphs` (the lean step captured per graph size) over a
    full-length cache; same arguments as `ForwardStep`. A failure drops the graphs and raises
    `GraphDecodeFailed`: the loop never continues on another path."""

    fixed_shape = True  # every slot is read, and the live batch shrinks only to graph sizes

    def __init__(self, graphs: Any):
        self.graphs = graphs

    @property
    def capture_s(self) -> float:
        return self.graphs.capture_s

    def __call__(self, ids_M1, pos_M1, attn_MS, t: int):
        try:
            return self.graphs.step(ids_M1, pos_M1, attn_MS)
        except Exception as err:  # a capture can still fail (an op that syncs, an unsupported kernel)
            # close() raises, instead, if a capture is left open: then nothing may allocate.
            self.graphs.close()
            raise GraphDecodeFailed(f"{type(err).__name__}: {err}") from err


def device_free_bytes(device) -> Optional[int]:
    """Bytes a rollout may plan with on `device`: the device's free memory plus the cached segments
    torch's caching allocator holds wholly unused, less `rollout_memory.HEADROOM` of the device. None
    off CUDA: host memory is not planned (the batch is then max_batch_size, or everything)."""
    if device.type != "cuda":
        return None
    import torch

    from hybrid_rl.plan.rollout_memory import HEADROOM

    free, total = torch.cuda.mem_get_info(device)
    return plannable_bytes(free, total, torch.cuda.memory_stats(device), HEADROOM)


def plannable_bytes(free: int, total: int, stats: dict, headroom: float) -> int:
    """free + the allocator's cached bytes a large new tensor can use, less headroom * total.

    reserved - allocated counts every unused cached byte, including the free pieces of segments
    that still hold a live block ("inactive_split_bytes"): the allocator never hands out a block
    larger than such a piece, and cannot return the segment to the device, so a KV cache sized
    on them would not fit. Only wholly unused segments count (they are freed, and re-allocated,
    on demand). Absent keys (an allocator not initialised yet) count 0."""
    cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
    unusable = stats.get("inactive_split_bytes.all.current", 0)
    return max(0, free + cached - unusable - int(headroom * total))
