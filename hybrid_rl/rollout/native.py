"""The native torch rollout engine: batched KV-cache decoding on the policy's own module.

Colocated, it needs no weight copy: `resume(["weights"])` all-gathers the FSDP2
shards once and keeps them whole for the whole rollout (so decoding runs no
collectives), `release(["weights"])` frees the gathered copy. This is the
zero-copy limit other engines are measured against, and it runs on CPU.

Legend: N sequences, P prompt tokens (left-padded), V vocab.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from hybrid_rl.models.fsdp import fsdp_modules, gather_full_weights, release_full_weights
from hybrid_rl.models.logprobs import left_pad, position_ids
from hybrid_rl.rollout.base import Completion, SamplingParams, check_tags


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


def kv_cache_bytes(cache) -> int:
    """Bytes held by a transformers cache object (0 if it is empty or unknown)."""
    total = 0
    for layer in getattr(cache, "layers", []) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class NativeEngine:
    """RolloutEngine over a torch causal LM (`model`), typically the policy itself."""

    def __init__(self, model: torch.nn.Module, pad_id: int, eos_id: int, max_batch_size: int = 0,
                 weights_dtype: torch.dtype | None = None, own_weights: bool = False):
        """own_weights: `model` is the engine's private copy (not the policy); releasing its
        weights frees their memory, and their contents, until the next update_weights,
        the way SGLang's memory saver does."""
        self.model = model
        self.own_weights = own_weights
        self._shapes = {n: (p.shape, p.dtype, p.device) for n, p in model.named_parameters()} if own_weights else {}
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.max_batch_size = max_batch_size  # 0: all prompts in one batch
        self._sharded = bool(fsdp_modules(model))
        self._weights_ready = not self._sharded
        self._kv_ready = True
        self.last_kv_bytes = 0  # KV cache size of the last generate call
        # Gathered (unsharded) weights are an extra full copy only when the module is sharded;
        # numel() of a DTensor is the global size. Mixed precision gathers in weights_dtype.
        counted = self._sharded or own_weights
        self._full_bytes = sum(p.numel() * (weights_dtype or p.dtype).itemsize for p in model.parameters()) if counted else 0

    def memory_bytes(self) -> dict[str, int]:
        """Engine-owned bytes: the gathered weights (while resumed) and the last rollout's KV cache."""
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

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights into the engine's module (only needed when it is not the policy itself)."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine model has no parameter {name!r}")
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    # -- decoding -------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not self._weights_ready or not self._kv_ready:
            raise RuntimeError("engine memory is released; call resume(['weights', 'kv_cache']) before generate")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        out: list[Completion] = []
        step = self.max_batch_size or max(1, len(prompt_ids))
        gen = torch.Generator(device=self._device()).manual_seed(params.seed)
        for start in range(0, len(prompt_ids), step):
            out += self._generate_batch(prompt_ids[start:start + step], params, gen)
        return out

    def _device(self) -> torch.device:
        return next(iter(self.model.parameters())).device

    def _generate_batch(self, prompts: list[list[int]], sp: SamplingParams, gen: torch.Generator) -> list[Completion]:
        from transformers import DynamicCache

        dev = self._device()
        ids, attn = left_pad(prompts, self.pad_id, dev)
        N = ids.shape[0]
        pos = position_ids(attn)
        stop_ids = torch.tensor(sorted({self.eos_id, *sp.stop_token_ids}), device=dev)

        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
        next_pos = pos[:, -1:] + 1
        finished = torch.zeros(N, dtype=torch.bool, device=dev)
        toks, lps = [], []
        for t in range(sp.max_new_tokens):
            scaled = logits.float() / sp.temperature
            logp_NV = scaled.log_softmax(-1)
            if sp.greedy:
                tok = scaled.argmax(-1)
            else:
                probs = filter_logits(scaled, sp.top_k, sp.top_p).softmax(-1)
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            lp = logp_NV.gather(-1, tok[:, None]).squeeze(-1)
            alive = ~finished
            toks.append(torch.where(alive, tok, self.pad_id))
            lps.append(lp)
            finished = finished | torch.isin(tok, stop_ids)
            if bool(finished.all()) or t == sp.max_new_tokens - 1:
                break
            # The token just sampled is a real input only for rows that were still alive.
            attn = torch.cat([attn, alive.long()[:, None]], dim=1)
            logits = self.model(input_ids=toks[-1][:, None], attention_mask=attn, position_ids=next_pos,
                                past_key_values=cache, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        self.last_kv_bytes = kv_cache_bytes(cache)
        del cache
        return self._to_completions(torch.stack(toks, 1), torch.stack(lps, 1), stop_ids)

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
