"""How the native engine decodes, decided in one place: CUDA graphs, the lean step, or the model's forward
(and which mask that forward gets), plus the device memory a rollout may plan with.

CUDA graphs capture only the lean step (`lean_step.py`). The generic Hugging Face forward
is never captured: under FSDP2 its module hooks make the all-gather streams wait on the
capturing stream, so the capture fails on every batch, and a failed capture is not free
(torch's `graph.__exit__` skips restoring the current stream when `capture_end` raises, and
leaves the pool recorded as capturing in the allocator: `decode_graph.py` undoes both). Where the model has no lean step the
engine decodes eagerly and says why once; a user who asked for graphs explicitly gets an error.

The forward path hands the model a ready 4-D (M, 1, 1, S) boolean mask only where the
attention implementation takes one (sdpa, eager) and every layer is full attention;
flash-attention (and any other implementation) gets the 2-D padding mask and transformers'
own mask builder, which is what flash-attention's varlen path reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MASK_4D_IMPLEMENTATIONS = ("sdpa", "eager")  # attention functions that accept a ready boolean 4-D mask


@dataclass(frozen=True)
class DecodePath:
    name: str  # "cuda_graph" (the lean step, captured), "lean" (eager) or "forward" (the model's forward)
    mask_4d: bool  # forward path only: pass attn_NS[:, None, None, :] instead of the 2-D mask
    note: Optional[str] = None  # why graphs are off where they would have been used (to log once)


def base_attention(implementation: str) -> str:
    """The attention implementation under the shared-prefix wrapper's name ('hybrid_rl_shared_prefix+sdpa' -> 'sdpa')."""
    return implementation.rsplit("+", 1)[-1]


def check_graph_request(cuda_graphs: Optional[bool], lean_step: Optional[bool], lean_reason: Optional[str]) -> None:
    """Refuse cuda_graphs=True where no lean step will run: the generic forward is never captured."""
    if not cuda_graphs:
        return
    if lean_step is False:
        raise ValueError("cuda_graphs=True needs the lean decode step, and lean_step=False turns it off; "
                         "set lean_step=None (or True), or cuda_graphs=None")
    if lean_reason is not None:
        raise ValueError(f"cuda_graphs=True needs the lean decode step, which this model lacks ({lean_reason}); "
                         "the Hugging Face forward is not captured (under FSDP2 the capture fails on every batch). "
                         "Set cuda_graphs=None (decode eagerly, said once) or False")


def choose_decode_path(device_type: str, cuda_graphs: Optional[bool], lean_step: Optional[bool],
                       lean_reason: Optional[str], full_attention: bool, attn_implementation: str) -> DecodePath:
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
        note = (f"CUDA graphs off: they capture only the lean decode step, which does not run here ({why}); "
                "decoding with the model's forward, eagerly")
    return DecodePath("lean" if lean else "forward", mask_4d, note)


def device_free_bytes(device) -> Optional[int]:
    """Bytes a rollout may plan with on `device`: the device's free memory plus the cached segments
    torch's caching allocator holds wholly unused, less `memory_rollout.HEADROOM` of the device. None
    off CUDA: host memory is not planned (the batch is then max_batch_size, or everything)."""
    if device.type != "cuda":
        return None
    import torch

    from hybrid_rl.memory_rollout import HEADROOM

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
