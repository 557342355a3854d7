"""The native torch rollout engine: batched KV-cache decoding on the policy's own module.

Colocated, it needs no weight copy: `resume(["weights"])` all-gathers the FSDP2
shards once and keeps them whole for the whole rollout (so decoding runs no
collectives), `release(["weights"])` frees the gathered copy. This is the
zero-copy limit other engines are measured against, and it runs on CPU.

Decoding (`_generate_batch`) keeps the work proportional to the live rows:
* the decode path (CUDA graph, lean step or the model's forward) is chosen once per rollout, and the
  token loop calls that path's step only (`decode_path.py`; a failed graph re-decodes its batch eagerly);
* a prompt repeated in the batch (its G samples) is prefilled once and its cache rows copied; rows that share
  a stem (the carried samples of one prompt, each with its own prefix) prefill the stem once and then their own
  tokens, in length buckets (`prefill_plan.py`); a carried row with a kept cache (rollout.partial_kv=keep:
  `PartialRequest.kv`, handed out at the last cut as `last_kept_kv`) is not prefilled at all: its cache is copied
  in and one forward feeds its last token (`_prefill_kept`);
* the KV cache is allocated once per batch at its final size (`kv_cache.StaticKVCache`);
* the token loop (`decode_loop.py`) never waits for the device except every `stop_check_every` tokens (on CUDA;
  on CPU there is nothing to wait for, so it checks every token), where
  it asks which rows are still alive; tokens a row samples after its stop are
  replaced by pad on the device, so checking late changes no output;
* at those checks, once enough rows have finished, they are dropped from the batch
  (cache and per-row state compacted in place);
* sampling (`sampler.py`) sorts the vocabulary only for top-p, draws by inverse CDF (one
  uniform per row and step, all drawn up front, so a sequence's tokens do not depend on its
  batch), and computes one log-sum-exp per row for the logprob;
* the one-token step skips transformers' generic forward for the Llama family
  (`lean_step.py`: the model's own modules, attention written out, no mask building);
* on CUDA the lean step is replayed as a CUDA graph (`decode_graph.py`), one per graph size
  (the live batch padded to a power of two); a failed capture turns graphs off for the engine; a
  model without the lean step is never captured (`decode_path.py`).

Memory: on CUDA a decode batch holds at most the rows whose KV cache and working set fit
the free memory, and the prefill runs in chunks of prompts that fit beside that cache
(`rollout_memory.native_budget`, the planner's own arithmetic).

Positions and masks are the trainer's (`models.logprobs`): left-padded prompts,
position ids counting real tokens only, so engine logprobs equal the trainer's.

Legend: N sequences, M sequences still in the decode batch, P prompt tokens
(left-padded), T new tokens, S = P + T - 1 cache slots, V vocab, K stop ids.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Callable, Iterable, Optional, Sequence

import torch

from hybrid_rl.models.fsdp import fsdp_modules, gather_full_weights, release_full_weights
from hybrid_rl.models.loading import all_full_attention, attention_implementation, model_config
from hybrid_rl.models.logprobs import left_pad, position_ids
from hybrid_rl.plan.memory import ModelArch
from hybrid_rl.plan.rollout_memory import RolloutShape, native_budget
from hybrid_rl.rollout.base import check_tags
from hybrid_rl.rollout.native.decode_loop import (
    DecodeStats,
    GroupStop,
    Prefilled,
    RowLimits,
    check_every,
    decode,
    to_completions,
)
from hybrid_rl.rollout.native.decode_path import (
    MASK_4D_IMPLEMENTATIONS,
    DecodePath,
    ForwardStep,
    GraphDecodeFailed,
    GraphStep,
    LeanDecodeStep,
    base_attention,
    check_graph_request,
    choose_decode_path,
    device_free_bytes,
)
from hybrid_rl.rollout.native.kv_cache import StaticKVCache
from hybrid_rl.rollout.native.lean_step import LeanStep, unsupported_reason
from hybrid_rl.rollout.native.prefill_plan import FORWARD_TOKENS, plan_prefill
from hybrid_rl.rollout.native.sampler import _draw, filter_logits, sample_tokens  # noqa: F401  (re-exported: tests and benchmarks import them from here)
from hybrid_rl.types import Completion, PartialRequest, SamplingParams, WeightUpdates


class NativeEngine:
    """RolloutEngine over a torch causal LM (`model`), typically the policy itself."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        eos_id: int,
        max_batch_size: int = 0,
        weights_dtype: torch.dtype | None = None,
        own_weights: bool = False,
        stop_check_every: int | None = None,
        cuda_graphs: bool | None = None,
        lean_step: bool | None = None,
        free_memory: Optional[Callable[[torch.device], Optional[int]]] = None,
    ):
        """own_weights: `model` is the engine's private copy (not the policy); releasing its
        weights frees their memory, and their contents, until the next update_weights,
        the way SGLang's memory saver does.

        stop_check_every: tokens between the host checks for finished rows (where the loop
        may end early and finished rows are dropped); at most this many - 1 steps are
        decoded after the last row stops. None: 8 on CUDA (a check waits for the device),
        1 elsewhere. cuda_graphs: replay the lean decode step as CUDA graphs; None = on when the
        model is on CUDA and has the lean step; True without a lean step raises. lean_step: decode
        eagerly through `LeanStep` instead of the model's forward; None = where the model is supported.
        max_batch_size: rows decoded at once at most (0: no limit but memory). free_memory(device):
        the bytes a rollout may plan with (default `decode_path.device_free_bytes`: measured on CUDA,
        None = unlimited elsewhere); the decode batch and prefill chunk are sized from it.
        """
        if stop_check_every is not None and stop_check_every < 1:
            raise ValueError(f"stop_check_every must be >= 1, got {stop_check_every}")
        if max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0 (0: as many rows as fit), got {max_batch_size}")
        check_graph_request(cuda_graphs, lean_step, unsupported_reason(model))
        self.model = model
        self.own_weights = own_weights
        self._shapes = {n: (p.shape, p.dtype, p.device) for n, p in model.named_parameters()} if own_weights else {}
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.max_batch_size = max_batch_size  # 0: all prompts in one batch
        self.stop_check_every = stop_check_every
        self.cuda_graphs = cuda_graphs
        self.lean_step = lean_step
        self.free_memory = free_memory or device_free_bytes
        self.act_bytes = (weights_dtype or next(iter(model.parameters())).dtype).itemsize  # activations and KV
        self._shape: RolloutShape | None = None
        self._notes_logged: set[str] = set()
        self.last_batch_rows = 0  # rows of the last generate call's decode batches (its cap)
        self.last_prefill_rows = 0  # prompts per prefill forward in the last generate call
        self.last_prefill_forwards = 0  # prefill forwards of the last generate call (buckets x chunks, both phases)
        self._slot_cap: int | None = None  # prompt slots the memory budget was planned with (None: unplanned)
        self.last_decode_path = ""  # how the last batch decoded, all of it: "cuda_graph", "lean" or "forward"
        self._sharded = bool(fsdp_modules(model))
        self._weights_ready = not self._sharded
        self._kv_ready = True
        self.last_kv_bytes = 0  # KV cache size of the last generate call (the largest batch's)
        self.last_graph_error: str | None = None  # why CUDA graphs were not used, if asked for or failed
        self._graphs_failed = False  # a capture failed: no more attempts on this engine
        self.last_capture_s = 0.0  # seconds the last generate call spent capturing CUDA graphs
        # Gathered (unsharded) weights are an extra full copy only when the module is sharded;
        # numel() of a DTensor is the global size. Mixed precision gathers in weights_dtype.
        counted = self._sharded or own_weights
        self._full_bytes = (
            sum(p.numel() * (weights_dtype or p.dtype).itemsize for p in model.parameters()) if counted else 0
        )

    def memory_bytes(self) -> dict[str, int]:
        """Engine-owned bytes: the gathered weights (while resumed) and the last rollout's KV cache
        (its largest batch's, allocated whole at the prefill: rows x (P + max_new_tokens - 1) slots)."""
        return {"engine_weights": self._full_bytes if self._weights_ready else 0, "kv_cache": self.last_kv_bytes}

    # -- memory ---------------------------------------------------------------
    def resume(self, tags: Sequence[str]) -> None:
        check_tags(tags)
        if "weights" in tags and not self._weights_ready:
            if self.own_weights:
                for name, p in self.model.named_parameters():
                    shape, dtype, device = self._shapes[name]
                    p.data = torch.empty(shape, dtype=dtype, device=device)  # filled by the next sync
            else:
                gather_full_weights(self.model, keep_resident=True)
            self._weights_ready = True
        if "kv_cache" in tags:
            self._kv_ready = True
            self.last_kv_bytes = 0

    def release(self, tags: Sequence[str]) -> None:
        check_tags(tags)
        if "kv_cache" in tags:
            # The cache lives only inside generate(); releasing forbids new allocations.
            self._kv_ready = False
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if "weights" in tags and self._weights_ready and (self._sharded or self.own_weights):
            if self.own_weights:
                for p in self.model.parameters():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            else:
                release_full_weights(self.model)
            self._weights_ready = False

    def begin_weight_update(self) -> None:
        """Nothing to open: buckets are copied as they come."""

    def end_weight_update(self) -> None:
        """Nothing to close."""

    def abort_weight_update(self) -> None:
        """Nothing to close."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights into the engine's module (only needed when it is not the policy itself)."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine model has no parameter {name!r}")
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    # -- decoding -------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        partial: PartialRequest | None = None,
        updates: WeightUpdates | None = None,
    ) -> list[Completion]:
        """Completions of the prompts (host lists: nothing made here reaches autograd).

        Inference mode, not just no_grad: the decode loop runs thousands of small ops, and
        skipping their version counters and view tracking saves 4-7% of a CPU rollout.

        partial (rollout.partial): each row's own budget and minimum, and the early stop once
        `partial.groups_needed` groups have finished; a decode batch that starts after that returns its
        rows unstarted ("abort", no tokens). A continued row's cache (prompt + its carried prefix) is recomputed
        under the current weights, as AReaL's interrupted requests are: the prompt once for all the rows that share
        it, then each row's prefix (`prefill_plan.py`).

        updates (trainer.inflight_update=continue, types.WeightUpdates): polled before each decode batch and at each
        stop check; a version applied there is copied into the module in place, and the rows go on decoding with it
        over the cache the older weights wrote (PipelineRL's in-flight update). `last_update_marks` says where.
        """
        if not self._weights_ready or not self._kv_ready:
            raise RuntimeError("engine memory is released; call resume(['weights', 'kv_cache']) before generate")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        self.last_tail_s, self.last_generated_tokens, self.last_prefill_forwards = 0.0, 0, 0
        self.last_update_marks: list[list[int]] = []
        self.last_kept_kv: list[Optional[torch.Tensor]] = [None] * len(prompt_ids)  # PartialRequest.keep_kv
        if not prompt_ids:  # a rank with no rows this round (an uneven validation split)
            return []
        if partial is not None:
            partial.check(len(prompt_ids), params)
            self._check_kept(prompt_ids, partial.kv)
        dev, N, T = self._device(), len(prompt_ids), params.max_new_tokens
        path = self._decode_path(dev)  # once per rollout: the token loop never chooses
        rows, prefill_rows = self._batch_limits(prompt_ids, params, dev, path, widen=partial is not None)
        gen = torch.Generator(device=dev).manual_seed(params.seed)
        # One uniform per (sequence, step), drawn before any batching: a sequence samples the same
        # tokens whichever batch the free memory puts it in, and whichever rows were dropped.
        u_NT = None if params.greedy else torch.rand((N, T), generator=gen, dtype=torch.float64, device=dev)
        self.last_kv_bytes, self.last_capture_s = 0, 0.0
        self.last_batch_rows, self.last_prefill_rows = rows, prefill_rows
        stop = GroupStop(partial) if partial is not None else None
        stats = DecodeStats()
        out: list[Completion] = []
        for start in range(0, N, rows):
            batch, u = prompt_ids[start : start + rows], None if u_NT is None else u_NT[start : start + rows]
            if stop is not None and stop.enough():  # the step has its groups: the rest wait, unstarted
                out += [Completion([], [], "abort") for _ in batch]
                continue
            limits = None if stop is None else stop.limits(start, len(batch), dev)
            kv = partial.kv[start : start + len(batch)] if partial is not None and partial.kv else None
            poll, marked = self._updates_poll(updates, start, len(batch), N), len(self.last_update_marks)
            if poll is not None:
                poll(0)  # versions that arrived between batches: this batch's every token is theirs
            done = self._try_batch(batch, params, u, path, prefill_rows, limits, stats, poll, kv)
            if done is None:  # its CUDA graphs failed: this batch again, and the rest, through the lean step
                path = replace(path, name="lean")
                limits = None if stop is None else stop.limits(start, len(batch), dev)
                for marks in self.last_update_marks[marked:]:  # the batch restarts under the newest weights
                    marks[start : start + len(batch)] = [0] * len(batch)
                done = self._generate_batch(batch, params, u, path, prefill_rows, limits, stats, poll, kv)
            if stop is not None:
                stop.record(start, done)
            if limits is not None and limits.kept_kv:
                for i, row_kv in limits.kept_kv.items():
                    self.last_kept_kv[start + i] = row_kv
            out += done
        self.last_tail_s = stats.tail_s
        self.last_generated_tokens = sum(len(c.token_ids) for c in out)
        return out

    def _updates_poll(self, updates: WeightUpdates | None, start: int, n: int, N: int) -> Callable[[int], None] | None:
        """poll(held) for the decode batch of rows start..start+n of N: apply what `updates` has and mark each applied
        version (rows of earlier batches are finished, every token older; later rows hold none yet)."""
        if updates is None:
            return None

        def poll(held: int) -> None:
            for _ in range(updates.poll()):
                self.last_update_marks.append([1 << 30] * start + [held] * n + [0] * (N - start - n))

        return poll

    def _try_batch(
        self,
        prompts: list[list[int]],
        sp: SamplingParams,
        u_NT: torch.Tensor | None,
        path: DecodePath,
        prefill_rows: int,
        limits: RowLimits | None = None,
        stats: DecodeStats | None = None,
        poll: Callable[[int], None] | None = None,
        kv: Sequence[Optional[torch.Tensor]] | None = None,
    ) -> list[Completion] | None:
        """The batch's completions, or None when its CUDA graphs failed (said once; graphs stay off on this
        engine). Returning, not retrying here, frees the failed batch's cache (the error's frames hold it)."""
        try:
            return self._generate_batch(prompts, sp, u_NT, path, prefill_rows, limits, stats, poll, kv)
        except GraphDecodeFailed as err:
            self.last_graph_error, self._graphs_failed = str(err), True
            warnings.warn(
                f"CUDA-graph decode failed, decoding eagerly from now on (this batch again, from its "
                f"prefill): {self.last_graph_error}"
            )
            return None

    def _device(self) -> torch.device:
        return next(iter(self.model.parameters())).device

    def _log_once(self, note: str) -> None:
        if note not in self._notes_logged:
            self._notes_logged.add(note)
            warnings.warn(note)

    def _decode_path(self, dev: torch.device) -> DecodePath:
        """The rollout's decode path; a flag asked for and not honoured is said here, not per batch or token."""
        path = choose_decode_path(
            dev.type,
            self.cuda_graphs,
            self.lean_step,
            unsupported_reason(self.model),
            all_full_attention(self.model),
            attention_implementation(self.model),
        )
        if path.note:
            self._log_once(path.note)
        if self.cuda_graphs and dev.type != "cuda":
            self.last_graph_error = f"CUDA graphs need a CUDA device, the model is on {dev}"
            warnings.warn(f"cuda_graphs=True ignored: {self.last_graph_error}")
        if self.lean_step and path.name == "forward":
            self._log_once(
                f"lean_step=True ignored: {unsupported_reason(self.model)}; decoding with the model's forward"
            )
        if path.name == "cuda_graph" and self._graphs_failed:  # a capture failed on this engine: no more attempts
            return replace(path, name="lean")
        return path

    def _batch_limits(
        self, prompts: list[list[int]], sp: SamplingParams, dev: torch.device, path: DecodePath, widen: bool = False
    ) -> tuple[int, int]:
        """(rows per decode batch, prompts per prefill forward): max_batch_size, then what the
        memory that `free_memory` reports holds (`rollout_memory.native_budget`).

        widen: the shared prefill layout may hold more prompt slots than the longest row (its longest stem + its
        longest suffix, prefill_plan.py): a partial rollout's call, whose carried rows pay for it. Any other call
        shares stems only where the layout fits the longest row (a chat template's common prefix does), so its cache
        is the size the planner bills (rollout_memory: the longest prompt) and the same from step to step."""
        N = len(prompts)
        rows = min(N, self.max_batch_size or N)
        free = self.free_memory(dev)
        self._slot_cap = None if widen else max(map(len, prompts))
        if free is None:
            return rows, rows
        if self._shape is None:
            self._shape = RolloutShape.of(ModelArch.from_hf_config(model_config(self.model).to_dict()))
        share = base_attention(attention_implementation(self.model)) in MASK_4D_IMPLEMENTATIONS
        # The prompt slots of the shared layout (the longest row's when nothing is shared); a decode batch whose own
        # layout would be wider prefills its rows whole (prefill_plan.plan_prefill's max_slots).
        P, T = plan_prefill(prompts, N, 0, share, self._slot_cap).P, sp.max_new_tokens
        self._slot_cap = P
        budget = native_budget(
            self._shape,
            self.act_bytes,
            free,
            rows,
            P,
            T,
            top_p=sp.top_p < 1.0,
            graphs=path.name == "cuda_graph",
            eager_attention=base_attention(attention_implementation(self.model)) == "eager",
            samples_per_prompt=max(1, N // len({tuple(p) for p in prompts})),
        )
        if budget.rows == 0:
            one = native_budget(self._shape, self.act_bytes, 1 << 62, 1, P, T, sp.top_p < 1.0)
            raise RuntimeError(
                f"rollout: {free / 1e9:.2f} GB free on {dev} (after the headroom) holds not even one sequence of "
                f"{P} prompt + {T} new tokens ({one.peak / 1e9:.2f} GB with its prefill and sampling); offload more "
                "(offload.optimizer=true, offload.ref=true) or shorten data.max_prompt_tokens / rollout.max_new_tokens"
            )
        return budget.rows, budget.prefill_rows

    def _decode_step(self, path: DecodePath, cache: StaticKVCache, dev: torch.device, P: int):
        """The batch's step function on the rollout's `path` (decode_path.py), over its prefilled `cache`."""
        if path.name == "forward":
            return ForwardStep(self.model, cache, P, path.mask_4d)
        lean = LeanStep(self.model)
        if path.name == "lean":
            return LeanDecodeStep(lean, cache, P)
        cache.set_full_length(True, dev)
        return GraphStep(self._new_graphs(cache, dev, lean))

    def _new_graphs(self, cache: StaticKVCache, dev: torch.device, lean: LeanStep):
        from hybrid_rl.rollout.native.decode_graph import DecodeGraphs

        return DecodeGraphs(self.model, cache, dev, lean=lean)

    def _prefill_pieces(
        self, ids_RW: torch.Tensor, attn_RS: torch.Tensor, pos_RS: torch.Tensor, cache: StaticKVCache, pieces
    ) -> torch.Tensor:
        """logits_RV of each row's next token: one forward per bucket (a, b, L) of `prefill_plan`, rows a..b-1's last
        L tokens of ids_RW (left-padded to W) written at the slots that end at S (attn_RS: the rows' masks over those
        S slots, pos_RS their positions), over what the cache holds before them."""
        S, W = attn_RS.shape[1], ids_RW.shape[1]
        parts = []
        for k in pieces:
            cache.window(k.a, k.b, S - k.L)
            parts.append(
                self.model(
                    input_ids=ids_RW[k.a : k.b, W - k.L :],
                    attention_mask=attn_RS[k.a : k.b],
                    position_ids=pos_RS[k.a : k.b, S - k.L :],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[:, -1]
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _generate_batch(
        self,
        prompts: list[list[int]],
        sp: SamplingParams,
        u_NT: torch.Tensor | None,
        path: DecodePath,
        prefill_rows: int,
        limits: RowLimits | None = None,
        stats: DecodeStats | None = None,
        poll: Callable[[int], None] | None = None,
        kv: Sequence[Optional[torch.Tensor]] | None = None,
    ) -> list[Completion]:
        """Completions of one decode batch: prefill, build `path`'s step, run the token loop with it. kv: the
        rows' kept keys and values (PartialRequest.kv), None or a row's None where there are none."""
        dev = self._device()
        stop_K = torch.tensor(sorted({self.eos_id, *sp.stop_token_ids}), device=dev)
        batch = self._prefill_batch(prompts, sp.max_new_tokens, dev, prefill_rows, kv)
        step = self._decode_step(path, batch.cache, dev, batch.P)
        every = check_every(self.stop_check_every, dev.type)
        try:
            toks_NT, lps_NT = decode(batch, step, sp, u_NT, stop_K, self.pad_id, every, limits, stats, poll)
        finally:
            self.last_capture_s += step.capture_s
        self.last_kv_bytes = max(self.last_kv_bytes, batch.cache.nbytes())
        self.last_decode_path = path.name
        del batch, step  # the cache (and any graphs) before the host copies
        return to_completions(toks_NT, lps_NT, stop_K, limits)

    def _prefill_batch(
        self,
        prompts: list[list[int]],
        T: int,
        dev: torch.device,
        prefill_rows: int,
        kv: Sequence[Optional[torch.Tensor]] | None = None,
    ) -> Prefilled:
        """The cache allocated at its final size and filled with the prompts (`prefill_plan.py`).

        A prompt's G samples share its prefill, and so do carried rows that continue samples of one prompt: each
        distinct stem runs once (phase 1, in length buckets), each distinct row's tokens after it once (phase 2,
        attending to its stem's copy), then the rows of the cache, logits and masks are copied to every sample.
        A row with kept keys and values (kv, rollout.partial_kv=keep) is not recomputed: they are copied in,
        left-padded to end where the prompt slots do less one, and one forward runs the kept rows' last tokens."""
        kept = [i for i, x in enumerate(kv or ()) if x is not None]
        is_kept = set(kept)
        fresh = [i for i in range(len(prompts)) if i not in is_kept]
        # Stems, gaps and buckets at slot offsets need a mask the attention reads as given (sdpa, eager); any other
        # implementation (flash-attention's varlen path) gets the left-padded whole rows, one bucket, as before.
        share = base_attention(attention_implementation(self.model)) in MASK_4D_IMPLEMENTATIONS
        forward_tokens = FORWARD_TOKENS.get(dev.type, 0) if share else 1 << 40
        plan = None
        if fresh:
            plan = plan_prefill([prompts[i] for i in fresh], prefill_rows, forward_tokens, share, self._slot_cap)
        N, U = len(prompts), len(plan.rows) if plan else 0
        P = max([plan.P if plan else 0] + [len(prompts[i]) for i in kept])  # a kept row: L = len - 1, its last token
        cache = StaticKVCache(N, P + T - 1)
        attn_RP = torch.zeros((U + len(kept), P), dtype=torch.long, device=dev)  # the distinct rows, then the kept
        parts = [self._prefill_fresh(plan, cache, attn_RP, dev)] if plan else []  # left-padded to end at P too
        if kept:
            parts.append(self._prefill_kept([prompts[i] for i in kept], [kv[i] for i in kept], cache, attn_RP, U, dev))
        logits_RV = parts[0] if len(parts) == 1 else torch.cat(parts)
        cache.window(0, U + len(kept), P)
        src = [0] * N  # each row's buffer row
        for i, u in zip(fresh, plan.src if plan else ()):
            src[i] = u
        for j, i in enumerate(kept):
            src[i] = U + j
        src_N = torch.tensor(src, device=dev)
        cache.expand_rows(src_N)
        attn_NS = torch.zeros((N, P + T - 1), dtype=torch.bool, device=dev)
        attn_NS[:, :P] = attn_RP.bool()[src_N]
        pos_N1 = attn_RP.sum(-1, keepdim=True)[src_N]
        self.last_prefill_forwards += (plan.forwards() if plan else 0) + (1 if kept else 0)
        return Prefilled(cache, attn_NS, pos_N1, logits_RV[src_N], P)

    def _prefill_fresh(self, plan, cache: StaticKVCache, attn_RP: torch.Tensor, dev: torch.device) -> torch.Tensor:
        """`plan`'s U distinct rows prefilled into buffer rows 0..U-1, their masks written in attn_RP[:U]; logits_UV.
        Their layout is the plan's, shifted right by d = P - plan.P (a kept row longer than them widens the prompt
        slots): more left padding, never a gap before the first fed-back token, which varlen attention cannot read."""
        U, n_x, d = len(plan.rows), plan.n_suffix, attn_RP.shape[1] - plan.P
        P_s = plan.P_s + d
        ids_US, attn_US = left_pad([list(s) for s in plan.stems], self.pad_id, dev)
        attn_US = torch.nn.functional.pad(attn_US, (d, 0))
        logits_V = self._prefill_pieces(ids_US, attn_US, position_ids(attn_US), cache, plan.stem_buckets)
        cache.window(0, len(plan.stems), P_s)
        stem_U = torch.tensor(plan.stem_of, device=dev)
        cache.expand_rows(stem_U)  # each distinct row starts as its stem's copy
        # True = a slot the next forward may attend to: the row's real tokens (its stem's, then its own after a
        # masked gap), then each fed-back token (finished rows included: their outputs are discarded anyway).
        attn_UP = torch.zeros((U, plan.P + d), dtype=attn_US.dtype, device=dev)
        attn_UP[:, :P_s] = attn_US[stem_U]
        logits_V = logits_V[stem_U]
        if n_x:
            ids_XW, attn_XW = left_pad([list(plan.suffix(u)) for u in range(n_x)], self.pad_id, dev)
            attn_UP[:n_x, P_s:] = attn_XW
            pos_XP = position_ids(attn_UP[:n_x])  # real tokens only: a suffix continues its stem's positions
            logits_V[:n_x] = self._prefill_pieces(ids_XW, attn_UP[:n_x], pos_XP, cache, plan.suffix_buckets)
        attn_RP[:U] = attn_UP
        return logits_V

    def _prefill_kept(
        self,
        prompts: list[list[int]],
        kv: list[torch.Tensor],
        cache: StaticKVCache,
        attn_RP: torch.Tensor,
        U: int,
        dev: torch.device,
    ) -> torch.Tensor:
        """The kept rows into buffer rows U..: their keys and values (L slots each) end at slot P - 1, and one forward
        feeds each row's last token at slot P - 1, position L; their masks written in attn_RP[U:]; logits_KV."""
        K, P = len(prompts), attn_RP.shape[1]
        cache.write_rows_kv(U, kv, P - 1, dev)
        for j, row in enumerate(kv):
            attn_RP[U + j, P - 1 - row.shape[3] :] = 1
        cache.window(U, U + K, P - 1)
        return self.model(
            input_ids=torch.tensor([[p[-1]] for p in prompts], device=dev),
            attention_mask=attn_RP[U:],
            position_ids=torch.tensor([[row.shape[3]] for row in kv], device=dev),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]

    def _check_kept(self, prompts: list[list[int]], kv: Sequence[Optional[torch.Tensor]]) -> None:
        """Refuse kept keys and values that cannot be their row's: (layers, 2, KV heads, tokens, head dim) of this
        model, covering every token of the row but its last."""
        if not any(row is not None for row in kv):
            return
        arch = ModelArch.from_hf_config(model_config(self.model).to_dict())
        for i, row in enumerate(kv):
            if row is None:
                continue
            n = len(prompts[i])
            want = (arch.num_hidden_layers, 2, arch.kv_heads, n - 1, arch.head_dim)
            if tuple(row.shape) != want:
                raise ValueError(
                    f"PartialRequest.kv[{i}]: shape {tuple(row.shape)}, not {want} (layers, 2, KV heads, tokens, head "
                    f"dim) for a row of {n} tokens of this model; pass the engine's last_kept_kv entry of the row it "
                    "continues, or None to recompute the row"
                )
