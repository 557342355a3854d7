"""The native engine's rollout memory: what a decode batch costs beyond its KV cache, and how
many rows fit (pure arithmetic, no torch import; the planner and the engine share it). At the end,
the KV cache vLLM allocates at start-up (the planner and rollout/vllm/engine.py share that too).

The KV cache is not the whole bill. A native rollout of R rows, P prompt tokens and T new
tokens (S = P + T - 1 cache slots) also holds, per GPU (b = activation dtype bytes; h hidden,
I intermediate, H heads, K kv heads, d head_dim, V vocab, L layers):

  kv cache         R * 2*L*K*d*b * S                      allocated whole at the prefill
  prefill          u * (P * prefill_token + V*b)          u prompts per prefill chunk, one layer live:
                   prefill_token = b*(3I + 6h + (H + 2K)*d) + 8h
                   (the MLP's act(gate), up and their product; q, k, v, the attention output,
                   residual and norm copies; the norms' fp32 upcast). Eager attention adds
                   H*P*P*(8 + 2b) per prompt (fp32 softmax over the full score matrix); sdpa's
                   fused kernels do not materialise it.
  sampling         R * V * (b + 32)  with top-p,  R * V * (b + 8) without
                   (the logits, their fp32 copy, and top-p's sort: values, int64 order,
                   probabilities, cumulative sum, masks, the filtered copy)
  decode step      R * (H*S*(12 + b) + b*(3I + 6h + (H + 2K)*d) + 8h + V*b)
                   (the lean step's fp32 scores, biased scores and softmax over S slots, one
                   layer's MLP and projections, the logits)
  graph pools      R * 2*V*b  with CUDA graphs (the step above stays reserved in the pool, and
                   every graph size's logits output is kept: graph sizes halve, so they sum to < 2R rows;
                   while a size is captured, its eager warm-up's logits and their difference from the
                   replay's, both in b bytes, are live too: within the sampling term's fp32 copies, which
                   are freed by then)
  bookkeeping      R * (K*S*d*b + 12T + S)  (a compaction's gather of one layer's rows,
                   tokens int64 + logprobs fp32, the bool attention mask)

The prefill and the decode loop do not overlap, so the peak is KV + max(prefill, decode),
where decode = sampling + step + pools + bookkeeping (summed: an upper bound, since in
eager mode the step's temporaries are freed before sampling). One batch's KV cache: the
engine frees a batch's cache before the next one's prefill (kv_cache.py keeps the cache out of
reference cycles for that; an H200 run measured the bill plus the previous batch's cache when it
did not). Not billed: the rollout's uniforms, 8*T bytes per prompt of the whole call (under a
MB for a thousand prompts of 100 tokens). `HEADROOM` of the device is left unplanned for the
allocator's fragmentation, the CUDA context, NCCL buffers and cuBLAS's workspaces (one per stream
that has run a matmul, kept for the process's life: 32 MiB + 1 MiB for cuBLASLt on Hopper; a
rollout makes the default stream's and the graph capture stream's the first time they run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybrid_rl.plan.arch import dtype_bytes

HEADROOM = 0.05  # fraction of device memory no rollout plan uses


@dataclass(frozen=True)
class RolloutShape:
    """The model numbers the bill needs (a `plan.arch.ModelArch` has them all)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, arch) -> "RolloutShape":
        return cls(
            arch.hidden_size,
            arch.intermediate_size,
            arch.num_hidden_layers,
            arch.num_attention_heads,
            arch.kv_heads,
            arch.head_dim,
            arch.vocab_size,
        )


@dataclass(frozen=True)
class RolloutBudget:
    """Rows decoded at once, prompts per prefill chunk, and the bytes each part of the bill takes."""

    rows: int  # decode batch (R); 0 when not even one row fits
    prefill_rows: int  # prompts per prefill forward (u)
    kv_cache: int
    prefill: int
    sampling: int
    decode_step: int
    graph_pools: int
    bookkeeping: int
    free: int  # what the plan was given

    @property
    def working(self) -> int:
        """Everything but the KV cache, at its peak (prefill and decode do not overlap)."""
        return max(self.prefill, self.sampling + self.decode_step + self.graph_pools + self.bookkeeping)

    @property
    def peak(self) -> int:
        return self.kv_cache + self.working


def _b(dtype: str | int) -> int:
    if isinstance(dtype, int):
        return dtype
    return dtype_bytes(dtype)


def kv_row_bytes(m: RolloutShape, b: int, slots: int) -> int:
    return 2 * m.num_hidden_layers * m.kv_heads * m.head_dim * b * slots


def prefill_prompt_bytes(m: RolloutShape, b: int, prompt_tokens: int, eager_attention: bool = False) -> int:
    """One prompt's prefill working set (module docstring)."""
    per_token = b * (
        3 * m.intermediate_size + 6 * m.hidden_size + (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    )
    per_token += 8 * m.hidden_size
    scores = m.num_attention_heads * prompt_tokens * prompt_tokens * (8 + 2 * b) if eager_attention else 0
    return prompt_tokens * per_token + scores + m.vocab_size * b


def decode_row_bytes(m: RolloutShape, b: int, slots: int, new_tokens: int, top_p: bool, graphs: bool) -> dict[str, int]:
    """One decode row's sampling, step, graph-pool and bookkeeping bytes (module docstring)."""
    V = m.vocab_size
    step = (
        m.num_attention_heads * slots * (12 + b)
        + V * b
        + 8 * m.hidden_size
        + b * (3 * m.intermediate_size + 6 * m.hidden_size + (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim)
    )
    return {
        "sampling": V * (b + (32 if top_p else 8)),
        "decode_step": step,
        "graph_pools": 2 * V * b if graphs else 0,
        "bookkeeping": m.kv_heads * slots * m.head_dim * b + 12 * new_tokens + slots,
    }


def budget_for(
    m: RolloutShape,
    dtype: str | int,
    rows: int,
    prefill_rows: int,
    prompt_tokens: int,
    new_tokens: int,
    top_p: bool = True,
    graphs: bool = True,
    eager_attention: bool = False,
    free: int = 0,
) -> RolloutBudget:
    """The bill of decoding `rows` rows with prefill chunks of `prefill_rows` prompts."""
    b, S = _b(dtype), prompt_tokens + new_tokens - 1
    per_row = decode_row_bytes(m, b, S, new_tokens, top_p, graphs)
    return RolloutBudget(
        rows=rows,
        prefill_rows=prefill_rows,
        kv_cache=rows * kv_row_bytes(m, b, S),
        prefill=prefill_rows * prefill_prompt_bytes(m, b, prompt_tokens, eager_attention),
        free=free,
        **{k: rows * v for k, v in per_row.items()},
    )


def native_budget(
    m: RolloutShape,
    dtype: str | int,
    free: int,
    rows_wanted: int,
    prompt_tokens: int,
    new_tokens: int,
    top_p: bool = True,
    graphs: bool = True,
    eager_attention: bool = False,
    samples_per_prompt: int = 1,
) -> RolloutBudget:
    """The largest decode batch (<= rows_wanted) whose KV cache and working set fit in `free`
    bytes, then the largest prefill chunk that fits beside that KV cache (at most the batch's
    distinct prompts, rows / samples_per_prompt: a prompt's samples share one prefill).

    The batch is then balanced: ceil(rows_wanted / cap) batches of equal size, so a cap of
    600 for 640 rows decodes two batches of 320, not 600 and 40. rows == 0: nothing fits,
    not even one row with its one-prompt prefill.
    """
    if rows_wanted < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise ValueError(f"need rows, prompt and new tokens >= 1, got {rows_wanted}, {prompt_tokens}, {new_tokens}")
    b, S = _b(dtype), prompt_tokens + new_tokens - 1
    kv = kv_row_bytes(m, b, S)
    decode = sum(decode_row_bytes(m, b, S, new_tokens, top_p, graphs).values())
    one_prefill = prefill_prompt_bytes(m, b, prompt_tokens, eager_attention)
    cap = min(rows_wanted, max(0, free // (kv + decode)), max(0, (free - one_prefill) // kv))
    if cap < 1:
        return budget_for(m, b, 0, 0, prompt_tokens, new_tokens, top_p, graphs, eager_attention, free)
    rows = math.ceil(rows_wanted / math.ceil(rows_wanted / cap))
    u = max(1, min(math.ceil(rows / max(1, samples_per_prompt)), (free - rows * kv) // one_prefill))
    return budget_for(m, b, rows, u, prompt_tokens, new_tokens, top_p, graphs, eager_attention, free)


def bill_native_rollout(
    arch,
    dtype: str,
    rows_wanted: int,
    prompt_tokens: int,
    new_tokens: int,
    rollout: dict[str, int],
    usable: int,
    top_p: bool,
    graphs: bool,
    samples_per_prompt: int = 1,
) -> dict[str, int]:
    """Size the native engine's decode batch by what the rollout phase leaves of `usable` (the GPU
    less the planner's margin, plan.memory.margin_bytes: it covers the HEADROOM the engine keeps at
    run time), and bill it into `rollout` (kv_cache, rollout_working). Nothing fits: one row is
    billed, so the phase shows its shortfall."""
    if new_tokens < 1:
        raise ValueError(
            f"native_prompt_tokens={prompt_tokens} leaves no new tokens in context {prompt_tokens + new_tokens}"
        )
    if not (arch.has_kv_dims and arch.hidden_size and arch.intermediate_size and arch.vocab_size):
        raise ValueError("the native engine's rollout bill needs the full architecture (--model), not --params")
    shape = RolloutShape.of(arch)
    free = usable - sum(v for k, v in rollout.items() if k != "kv_cache")
    budget = native_budget(
        shape,
        dtype,
        max(0, free),
        rows_wanted,
        prompt_tokens,
        new_tokens,
        top_p,
        graphs,
        samples_per_prompt=samples_per_prompt,
    )
    if budget.rows == 0:
        budget = budget_for(shape, dtype, 1, 1, prompt_tokens, new_tokens, top_p, graphs, free=max(0, free))
    rollout["kv_cache"] = budget.kv_cache
    rollout["rollout_working"] = budget.working
    out = {
        k: getattr(budget, k)
        for k in (
            "rows",
            "prefill_rows",
            "kv_cache",
            "prefill",
            "sampling",
            "decode_step",
            "graph_pools",
            "bookkeeping",
            "free",
            "working",
        )
    }
    return {**out, "rows_wanted": rows_wanted, "fits_one_row": int(free >= budget.peak)}


def bill_sglang_kv(
    batch_need: int, usable: int, mem_fraction: float | None, per_gpu: dict[str, int], rollout: dict[str, int]
) -> list[str]:
    """SGLang's KV pool per GPU, billed into per_gpu and `rollout` (plan/memory.py's docstring: how SGLang sizes
    it at start-up); batch_need: one batch's KV bytes per GPU, billed as is when mem_fraction is None. The notes."""
    gb = 1e9
    if mem_fraction is None:
        return [
            f"sglang picks its own KV pool (rollout.mem_fraction=null); the kv_cache row bills one batch "
            f"({batch_need / gb:.2f} GB per GPU): set rollout.mem_fraction to plan the pool it allocates"
        ]
    at_start = sum(v for k, v in rollout.items() if k not in ("engine_weights", "kv_cache", "optimizer"))
    pool = max(0, int(mem_fraction * (usable - at_start)) - per_gpu["engine_weights"])
    per_gpu["kv_cache"] = rollout["kv_cache"] = pool
    if pool == 0:
        return [
            f"rollout.mem_fraction={mem_fraction} leaves SGLang no KV pool beside its weights: it will not "
            "start; raise rollout.mem_fraction or offload more"
        ]
    if pool < batch_need:
        return [
            f"SGLang's KV pool ({pool / gb:.2f} GB per GPU, rollout.mem_fraction={mem_fraction}) holds less "
            f"than one batch ({batch_need / gb:.2f} GB): it decodes the batch in rounds"
        ]
    return []


# -- An engine that sizes its own KV cache once, at start-up (vLLM) ----------------------------------
# vLLM allocates its KV cache whole when it starts and pages it in blocks; rollout/vllm/engine.py gives it
# rollout.kv_cache_bytes, or (null) one generate call's need from this formula, or on CUDA with
# rollout.mem_fraction lets it take gpu_memory_utilization x the device for its weights, activations
# and KV cache (vllm/v1/worker/gpu_worker.py: requested memory minus the non-KV memory it profiled).

VLLM_BLOCK_TOKENS = 128  # vLLM's CPU attention pages its KV cache in blocks of this many tokens (CUDA: 16)
VLLM_SPARE_BYTES = 4 << 20  # a few spare blocks: vLLM keeps one block aside (the null block)


def vllm_kv_need(
    arch, dtype: str | int, sequences: int, max_model_len: int, tp_size: int, block_tokens: int = VLLM_BLOCK_TOKENS
) -> int:
    """KV-cache bytes on one rank of a vLLM engine for `sequences` sequences (the whole engine's, all its
    TP ranks') of up to `max_model_len` tokens, each in whole blocks; the KV heads are split over tp."""
    b, slots = _b(dtype), math.ceil(max_model_len / block_tokens) * block_tokens
    return 2 * arch.num_hidden_layers * math.ceil(arch.kv_heads / tp_size) * arch.head_dim * b * slots * sequences


def vllm_kv_budget(
    arch,
    dtype: str | int,
    sequences: int,
    max_model_len: int,
    tp_size: int,
    configured: int | None = None,
    mem_fraction: float | None = None,
    device_bytes: int = 0,
    engine_weights: int = 0,
) -> int:
    """The KV-cache bytes one rank of a vLLM engine holds: `configured` (rollout.kv_cache_bytes, vLLM's
    kv_cache_memory_bytes, per GPU); else with `mem_fraction` (CUDA) what vLLM's share of the device
    leaves beside this rank's `engine_weights` (an upper bound: vLLM also subtracts its profiled
    activations); else one generate call's need (`vllm_kv_need`) plus VLLM_SPARE_BYTES."""
    if configured is not None:
        return int(configured)
    if mem_fraction is not None:
        return max(0, int(mem_fraction * device_bytes) - engine_weights)
    return vllm_kv_need(arch, dtype, sequences, max_model_len, tp_size) + VLLM_SPARE_BYTES


def bill_vllm_kv(
    arch,
    dtype: str,
    batch: int,
    context: int,
    n_gpus: int,
    tp_size: int,
    configured: int | None,
    mem_fraction: float | None,
    device_bytes: int,
    engine_weights: int,
) -> tuple[int, str]:
    """The planner's kv_cache for vLLM, per GPU (`vllm_kv_budget` for the batch's share of one engine, the
    sequences of its tp ranks), and a note ("" if none) when it cannot hold one batch."""
    engine_batch = math.ceil(batch * tp_size / n_gpus)
    kv = vllm_kv_budget(
        arch, dtype, engine_batch, context, tp_size, configured, mem_fraction, device_bytes, engine_weights
    )
    need = vllm_kv_need(arch, dtype, engine_batch, context, tp_size)
    if kv >= need:
        return kv, ""
    why = (
        "refuses to start (rollout.kv_cache_bytes)"
        if configured is not None
        else "decodes the batch in rounds (rollout.mem_fraction)"
    )
    return kv, (
        f"vLLM's KV cache ({kv / 1e9:.2f} GB per GPU) is below one batch's need ({need / 1e9:.2f} GB): "
        f"the engine {why}; raise it, or set it to null to size it from the batch"
    )
