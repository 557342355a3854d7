"""The native torch rollout engine: batched KV-cache decoding on the policy's own module.

Colocated, it needs no weight copy: `resume(["weights"])` all-gathers the FSDP2
shards once and keeps them whole for the whole rollout (so decoding runs no
collectives), `release(["weights"])` frees the gathered copy. This is the
zero-copy limit other engines are measured against, and it runs on CPU.

Decoding (`_generate_batch`) keeps the work proportional to the live rows:
* a prompt repeated in the batch (its G samples) is prefilled once and its cache rows copied;
* the KV cache is allocated once per batch at its final size (`kv_cache.StaticKVCache`);
* the loop never waits for the device except every `stop_check_every` tokens (on CUDA;
  on CPU there is nothing to wait for, so it checks every token), where
  it asks which rows are still alive; tokens a row samples after its stop are
  replaced by pad on the device, so checking late changes no output;
* at those checks, once enough rows have finished, they are dropped from the batch
  (cache and per-row state compacted in place);
* sampling sorts the vocabulary only for top-p, draws by inverse CDF (one uniform
  per row, no host sync), and computes one log-sum-exp per row for the logprob;
* the one-token step skips transformers' generic forward for the Llama family
  (`lean_step.py`: the model's own modules, attention written out, no mask building);
* on CUDA the one-token step is replayed as a CUDA graph (`decode_graph.py`), one per
  live-batch size (a power of two), falling back to eager decoding if capture fails.

Positions and masks are the trainer's (`models.logprobs`): left-padded prompts,
position ids counting real tokens only, so engine logprobs equal the trainer's.

Legend: N sequences, M sequences still in the decode batch, P prompt tokens
(left-padded), T new tokens, S = P + T - 1 cache slots, V vocab, K stop ids.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Sequence

import torch

from hybrid_rl.models.fsdp import fsdp_modules, gather_full_weights, release_full_weights
from hybrid_rl.models.logprobs import left_pad, position_ids
from hybrid_rl.rollout.base import Completion, SamplingParams, check_tags
from hybrid_rl.rollout.kv_cache import StaticKVCache
from hybrid_rl.rollout.lean_step import LeanStep, all_full_attention, unsupported_reason


def filter_logits(logits_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and outside the top-p nucleus."""
    if top_k > 0 and top_k < logits_NV.shape[-1]:
        kth = torch.topk(logits_NV, top_k, dim=-1).values[:, -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_NV, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_NV = logits_NV.masked_fill(drop, float("-inf"))
    return logits_NV


_DRAW_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _draw(w_MV: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row with probability w / w.sum() (w >= 0, unnormalised), by inverse CDF: one uniform per row.

    torch.multinomial draws one exponential per vocabulary entry, and a cumulative sum
    over the vocabulary is a sequential pass; on CPU either costs several times the
    model's own work for a small model. Two levels instead: block sums (one vectorised
    pass), a cumulative sum over the blocks, then one within the chosen block (both in
    fp64, so rounding moves no mass between distant tokens). v = (1 - u) * total is in (0, total]
    and each level takes the first entry whose cumulative sum reaches what is left of v,
    so the entry drawn always has a positive probability: a filtered token never wins.
    """
    M, V = w_MV.shape
    if V <= _DRAW_BLOCK:  # one block: the same draw without the block level (fewer ops per token)
        total_M1 = w_MV.sum(-1, keepdim=True).double()
        v_M1 = (1.0 - torch.rand((M, 1), generator=gen, dtype=torch.float64, device=w_MV.device)) * total_M1
        cum_MV = w_MV.cumsum(-1, dtype=torch.float64)
        return torch.searchsorted(cum_MV, torch.minimum(v_M1, cum_MV[:, -1:])).squeeze(1)
    B = _DRAW_BLOCK  # V > B here
    nb = -(-V // B)
    if nb * B != V:
        w_MV = torch.nn.functional.pad(w_MV, (0, nb * B - V))
    blocks_MnB = w_MV.view(M, nb, B)
    cum_Mn = blocks_MnB.sum(-1).double().cumsum(-1)
    u_M1 = torch.rand((M, 1), generator=gen, dtype=torch.float64, device=w_MV.device)
    v_M1 = (1.0 - u_M1) * cum_Mn[:, -1:]
    blk_M1 = torch.searchsorted(cum_Mn, v_M1)
    before_M1 = torch.where(blk_M1 > 0, cum_Mn.gather(-1, (blk_M1 - 1).clamp_(min=0)), 0.0)
    inner_MB = blocks_MnB.gather(1, blk_M1[:, :, None].expand(M, 1, B)).squeeze(1).cumsum(-1, dtype=torch.float64)
    rest_M1 = torch.minimum(v_M1 - before_M1, inner_MB[:, -1:])  # block sum and cumsum may differ in the last bit
    return (blk_M1 * B + torch.searchsorted(inner_MB, rest_M1)).squeeze(1)


def sample_tokens(logits_MV: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """tok_M and lp_M: the next token of each row and its log_softmax(logits / T), before any filtering.

    Greedy: argmax. top_p < 1: the top-k then nucleus mask of `filter_logits` (one sort).
    top_k > 0 alone: a draw among torch.topk's k logits. Otherwise: a draw from the softmax.
    """
    scaled_MV = logits_MV.float()
    if sp.temperature != 1.0:
        scaled_MV = scaled_MV / sp.temperature
    V = scaled_MV.shape[-1]
    if not sp.greedy and sp.top_p >= 1.0 and not 0 < sp.top_k < V:
        # Plain sampling: the unnormalised softmax serves both the draw and the log-sum-exp.
        max_M1 = scaled_MV.amax(-1, keepdim=True)
        w_MV = (scaled_MV - max_M1).exp_()
        lse_M1 = max_M1 + w_MV.sum(-1, keepdim=True).log()
        tok_M = _draw(w_MV, gen)
    else:
        lse_M1 = scaled_MV.logsumexp(-1, keepdim=True)
        if sp.greedy:
            tok_M = scaled_MV.argmax(-1)
        elif sp.top_p < 1.0:
            tok_M = _draw(filter_logits(scaled_MV, sp.top_k, sp.top_p).softmax(-1), gen)
        else:
            top_MK, idx_MK = scaled_MV.topk(sp.top_k, dim=-1)
            tok_M = idx_MK.gather(-1, _draw((top_MK - top_MK[:, :1]).exp(), gen)[:, None]).squeeze(-1)
    lp_M = (scaled_MV.gather(-1, tok_M[:, None]) - lse_M1).squeeze(-1)
    return tok_M, lp_M


def _alive_rows(done_M: torch.Tensor) -> torch.Tensor:
    """Indices of the rows not finished: the decode loop's only host synchronisation."""
    return torch.nonzero(~done_M).squeeze(1)


def check_every(requested: int | None, device_type: str) -> int:
    """Tokens between stop checks: as requested, else 8 on CUDA (a check waits for the device), else 1."""
    return requested or (8 if device_type == "cuda" else 1)


def _bucket(n: int) -> int:
    """The CUDA-graph batch size for n live rows: the next power of two."""
    return 1 << (n - 1).bit_length()


class NativeEngine:
    """RolloutEngine over a torch causal LM (`model`), typically the policy itself."""

    def __init__(self, model: torch.nn.Module, pad_id: int, eos_id: int, max_batch_size: int = 0,
                 weights_dtype: torch.dtype | None = None, own_weights: bool = False,
                 stop_check_every: int | None = None, cuda_graphs: bool | None = None,
                 lean_step: bool | None = None):
        """own_weights: `model` is the engine's private copy (not the policy); releasing its
        weights frees their memory, and their contents, until the next update_weights,
        the way SGLang's memory saver does.

        stop_check_every: tokens between the host checks for finished rows (where the loop
        may end early and finished rows are dropped); at most this many - 1 steps are
        decoded after the last row stops. None: 8 on CUDA (a check waits for the device),
        1 elsewhere. cuda_graphs: replay the decode step as CUDA graphs; None = on when the
        model is on CUDA and every layer is full attention. lean_step: decode eagerly through
        `LeanStep` instead of the model's forward; None = where the model is supported.
        """
        if stop_check_every is not None and stop_check_every < 1:
            raise ValueError(f"stop_check_every must be >= 1, got {stop_check_every}")
        self.model = model
        self.own_weights = own_weights
        self._shapes = {n: (p.shape, p.dtype, p.device) for n, p in model.named_parameters()} if own_weights else {}
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.max_batch_size = max_batch_size  # 0: all prompts in one batch
        self.stop_check_every = stop_check_every
        self.cuda_graphs = cuda_graphs
        self.lean_step = lean_step
        self.last_decode_path = ""  # how the last batch decoded: "cuda_graph", "lean" or "forward"
        self._sharded = bool(fsdp_modules(model))
        self._weights_ready = not self._sharded
        self._kv_ready = True
        self.last_kv_bytes = 0  # KV cache size of the last generate call (the largest batch's)
        self.last_graph_error: str | None = None  # why the last CUDA-graph capture fell back, if it did
        self._graphs_failed = False  # a capture failed: no more attempts on this engine
        self.last_capture_s = 0.0  # seconds the last generate call spent capturing CUDA graphs
        # Gathered (unsharded) weights are an extra full copy only when the module is sharded;
        # numel() of a DTensor is the global size. Mixed precision gathers in weights_dtype.
        counted = self._sharded or own_weights
        self._full_bytes = sum(p.numel() * (weights_dtype or p.dtype).itemsize for p in model.parameters()) if counted else 0

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
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of the prompts (host lists: nothing made here reaches autograd).

        Inference mode, not just no_grad: the decode loop runs thousands of small ops, and
        skipping their version counters and view tracking saves 4-7% of a CPU rollout.
        """
        if not self._weights_ready or not self._kv_ready:
            raise RuntimeError("engine memory is released; call resume(['weights', 'kv_cache']) before generate")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        out: list[Completion] = []
        step = self.max_batch_size or max(1, len(prompt_ids))
        gen = torch.Generator(device=self._device()).manual_seed(params.seed)
        self.last_kv_bytes = 0
        self.last_capture_s = 0.0
        for start in range(0, len(prompt_ids), step):
            out += self._generate_batch(prompt_ids[start:start + step], params, gen)
        return out

    def _device(self) -> torch.device:
        return next(iter(self.model.parameters())).device

    def _start_graphs(self, cache: StaticKVCache, dev: torch.device, full_attention: bool, lean: LeanStep | None):
        """DecodeGraphs over `cache` (capturing `lean` where there is one), or None: graphs off, a
        capture already failed on this engine, or asked for where they cannot run (then a
        warning, the reason in last_graph_error, and eager decoding)."""
        possible = dev.type == "cuda" and full_attention
        if self._graphs_failed or not (possible if self.cuda_graphs is None else self.cuda_graphs):
            return None
        if not possible:
            self.last_graph_error = f"CUDA graphs need a CUDA model with full attention in every layer (device {dev})"
            warnings.warn(f"cuda_graphs=True ignored: {self.last_graph_error}")
            return None
        from hybrid_rl.rollout.decode_graph import DecodeGraphs

        cache.set_full_length(True, dev)
        return DecodeGraphs(self.model, cache, dev, lean=lean)

    def _generate_batch(self, prompts: list[list[int]], sp: SamplingParams, gen: torch.Generator) -> list[Completion]:
        dev = self._device()
        # A prompt's G samples share its prefill: the unique prompts run once, then their rows of the
        # cache, logits and masks are copied to every sample (src_N: the unique prompt of each row).
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(p), len(first)) for p in prompts]
        unique = [list(p) for p in first]
        ids_UP, attn_UP = left_pad(unique, self.pad_id, dev)
        N, (U, P) = len(prompts), ids_UP.shape
        src_N = torch.tensor(src, device=dev)
        T = sp.max_new_tokens
        stop_K = torch.tensor(sorted({self.eos_id, *sp.stop_token_ids}), device=dev)
        cache = StaticKVCache(N, P + T - 1)
        cache.prefill_rows(U)
        # True = a slot the next forward may attend to: the prompt's real tokens, then each
        # fed-back token (finished rows included: their outputs are discarded anyway).
        attn_NS = torch.zeros((N, P + T - 1), dtype=torch.bool, device=dev)
        attn_NS[:, :P] = attn_UP.bool()[src_N]
        pos_UP = position_ids(attn_UP)
        logits_UV = self.model(input_ids=ids_UP, attention_mask=attn_UP, position_ids=pos_UP,
                               past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        cache.advance(P)
        cache.expand_rows(src_N)
        logits_MV, pos_NP = logits_UV[src_N], pos_UP[src_N]
        pos_M1 = pos_NP[:, -1:] + 1
        full_attention = all_full_attention(self.model)
        lean = self._start_lean()
        graphs = self._start_graphs(cache, dev, full_attention, lean)
        started_graphs = graphs
        every = check_every(self.stop_check_every, dev.type)

        toks_NT = torch.full((N, T), self.pad_id, dtype=torch.long, device=dev)
        lps_NT = torch.zeros((N, T), dtype=torch.float32, device=dev)
        rows_M = torch.arange(N, device=dev)  # original row of each live row
        done_M = torch.zeros(N, dtype=torch.bool, device=dev)
        for t in range(T):
            tok_M, lp_M = sample_tokens(logits_MV, sp, gen)
            tok_M = torch.where(done_M, self.pad_id, tok_M)
            toks_NT[rows_M, t] = tok_M
            lps_NT[rows_M, t] = lp_M
            done_M = done_M | torch.isin(tok_M, stop_K)
            if t == T - 1:
                break
            if (t + 1) % every == 0:
                alive_A = _alive_rows(done_M)
                if alive_A.numel() == 0:
                    break
                keep = self._rows_to_keep(alive_A, done_M, graphs is not None)
                if keep is not None:
                    cache.keep_rows(keep)
                    attn_NS[:keep.numel()] = attn_NS[keep]
                    rows_M, done_M, pos_M1, tok_M = rows_M[keep], done_M[keep], pos_M1[keep], tok_M[keep]
            M = rows_M.numel()
            attn_NS[:M, P + t] = True
            if graphs is not None:
                try:
                    logits_MV = graphs.step(tok_M[:, None], pos_M1, attn_NS[:M])
                except Exception as err:  # capture can fail on hooks, syncs or unsupported ops
                    # The same step would fail again: this engine decodes eagerly from now on
                    # (through the lean step where the model has one), without retrying.
                    self.last_graph_error = f"{type(err).__name__}: {err}"
                    self._graphs_failed = True
                    warnings.warn(f"CUDA-graph decode failed, decoding eagerly from now on: {self.last_graph_error}")
                    graphs = None
                    cache.set_full_length(False)
            if graphs is None and lean is not None:
                logits_MV = lean(tok_M[:, None], pos_M1, attn_NS[:M, :P + t + 1], cache)
            elif graphs is None:
                mask = attn_NS[:M, None, None, :P + t + 1] if full_attention else attn_NS[:M, :P + t + 1]
                logits_MV = self.model(input_ids=tok_M[:, None], attention_mask=mask,
                                       position_ids=pos_M1, past_key_values=cache, use_cache=True).logits[:, -1]
            cache.advance(1)
            pos_M1 = pos_M1 + 1
        self.last_kv_bytes = max(self.last_kv_bytes, cache.nbytes())
        self.last_capture_s += getattr(started_graphs, "capture_s", 0.0)
        self.last_decode_path = "cuda_graph" if graphs is not None else "lean" if lean is not None else "forward"
        del cache, graphs, started_graphs
        return self._to_completions(toks_NT, lps_NT, stop_K)

    def _start_lean(self) -> LeanStep | None:
        """The lean decode step, or None: off, or the model is not supported (asked for: a warning)."""
        if self.lean_step is False:
            return None
        lean = LeanStep.build(self.model)
        if lean is None and self.lean_step:
            warnings.warn(f"lean_step=True ignored: {unsupported_reason(self.model)}; decoding with the model's forward")
        return lean

    @staticmethod
    def _rows_to_keep(alive_A: torch.Tensor, done_M: torch.Tensor, graphs: bool) -> torch.Tensor | None:
        """Rows (indices into the M live rows) to keep after a stop check, or None to keep all.

        Eager: drop the finished rows once they are at least 1/8 of the batch (a compaction
        copies the live cache, about one decode step's KV reads). Graphs: shrink to the
        next power of two, filled up with finished rows, so few graphs are ever captured.
        """
        M, A = done_M.numel(), alive_A.numel()
        if graphs:
            target = _bucket(A)
            if target >= M:
                return None
            return torch.cat([alive_A, torch.nonzero(done_M).squeeze(1)[:target - A]])
        if M - A < max(1, M // 8):
            return None
        return alive_A

    def _to_completions(self, toks_NT: torch.Tensor, lps_NT: torch.Tensor, stop_ids: torch.Tensor) -> list[Completion]:
        toks, lps = toks_NT.tolist(), lps_NT.tolist()
        stops = set(stop_ids.tolist())
        out = []
        for row, lrow in zip(toks, lps):
            n, reason = len(row), "length"
            for j, tok in enumerate(row):
                if tok in stops:
                    n, reason = j + 1, "stop"
                    break
            out.append(Completion(token_ids=row[:n], logprobs=lrow[:n], finish_reason=reason))
        return out
