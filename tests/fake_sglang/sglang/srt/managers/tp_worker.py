"""One TP rank's model: load it, decode for real, load weights by name.

Every rank holds the full model (a real rank holds a shard of it); rank 0 decodes, and the
engine checks that every rank's weights equal rank 0's.

Legend: N rows of a generate batch (requests), P prompt tokens (left-padded), V vocab.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from sglang.srt.sampling.sampling_params import DEFAULT_SAMPLING_SEED

# FINISH_ABORT().to_json() (managers/schedule_batch.py): what an abort of a running request reports.
_ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
_DTYPES = {"auto": torch.float32, "float32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(model_path: str, load_format: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype = resolve_dtype(dtype)
    if load_format == "dummy":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch_dtype)
        # SGLang's dummy init: every parameter uniform in [-1e-3, 1e-3] from a fixed seed, so
        # all TP ranks agree and the output is garbage unlike the checkpoint's.
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-1e-3, 1e-3, generator=gen)
    elif load_format in ("auto", "safetensors"):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    else:
        raise ValueError(f"the sglang stand-in supports load_format 'auto', 'safetensors' or 'dummy', "
                         f"got {load_format!r}")
    return model.eval().requires_grad_(False)


def position_ids(attn_NP: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so a left-padded prompt starts at position 0."""
    return (attn_NP.cumsum(-1) - 1).clamp(min=0)


class TpModelWorker:
    def __init__(self, tp_rank: int, args: Dict[str, Any]):
        self.tp_rank = tp_rank
        self.model = load_model(args["model_path"], args["load_format"], args["dtype"])
        self.params = dict(self.model.named_parameters())
        self.vocab_size = self.model.config.vocab_size
        self.tokenizer = None
        if not args["skip_tokenizer_init"]:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args["model_path"])
        self.eos_ids = set(args["eos_token_ids"])
        self.deterministic = args["enable_deterministic_inference"]
        self.rng = torch.Generator().manual_seed(args["random_seed"])

    # -- weights ----------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], direct: bool) -> List[str]:
        """Copy tensors into parameters by name, casting dtype; return the names loaded.

        Like qwen2's load_weights, a name that is not a parameter is skipped silently
        (a name-mapping bug leaves stale weights); `direct` is SGLang's exact-name path,
        where an unknown name raises.
        """
        loaded = []
        for name, tensor in named_tensors:
            if name not in self.params:
                if direct:
                    raise KeyError(f"load_format='direct': {name!r} is not a parameter of the model")
                continue
            param = self.params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise AssertionError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match "
                                     f"the parameter's {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.append(name)
        return loaded

    def nan_params(self) -> List[str]:
        return [n for n, p in self.params.items() if torch.isnan(p).any()]

    # -- decoding ---------------------------------------------------------------
    @torch.no_grad()
    def generate(self, reqs: List[Dict[str, Any]], stream: Any = None,
                 rows: Optional[List[int]] = None) -> List[Dict[str, Any]]:
        """Decode all requests as one left-padded batch with a KV cache.

        Positions count real tokens only and padding is masked, so each row computes what
        the prompt alone would (logprobs as SGLang's sampler reports them, note 1.5).
        Finished rows leave the batch; randomness is drawn over the running rows in order.

        stream (a streamed generate, scheduler.py `_Stream`; None otherwise): asked for aborts before the
        prefill (those rows never start: "Abort in waiting queue", no tokens) and before each token (a row
        aborted then samples that token and finishes "abort", as Req.to_finish does); told of every token
        (`emit`). rows: each request's index in the whole generate call (what the stream speaks of).
        """
        rows = list(range(len(reqs))) if rows is None else rows
        prompts = [r["input_ids"] for r in reqs]
        sps = [r["sampling_params"] for r in reqs]
        results = [{"output_ids": [], "output_logprobs": [], "input_logprobs": None,
                    "finish_reason": {"type": "length", "length": sp["max_new_tokens"]}} for sp in sps]
        waiting = set() if stream is None else stream.abort_waiting(rows, results)
        P = max(len(p) for p in prompts)
        ids_NP = torch.zeros(len(reqs), P, dtype=torch.long)
        attn_NP = torch.zeros(len(reqs), P, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids_NP[i, P - len(prompt):] = torch.tensor(prompt)
            attn_NP[i, P - len(prompt):] = 1
        out = self.model(input_ids=ids_NP, attention_mask=attn_NP, position_ids=position_ids(attn_NP), use_cache=True)
        cache, last_NV = out.past_key_values, out.logits[:, -1].float()
        logp_NPV = torch.log_softmax(out.logits.float(), dim=-1) if any(r["return_logprob"] for r in reqs) else None
        for i, req in enumerate(reqs):
            if req["return_logprob"] and i not in waiting:
                logp_PV = logp_NPV[i, P - len(prompts[i]):]
                results[i]["input_logprobs"] = self._input_logprobs(prompts[i], logp_PV, req["logprob_start_len"])
        del out
        stop_ids = [set() if sp["ignore_eos"] else set(sp["stop_token_ids"]) | self.eos_ids for sp in sps]
        live = list(range(len(reqs)))  # the rows of the batch still decoding, in batch order
        keep = [k for k, i in enumerate(live) if sps[i]["max_new_tokens"] > 0 and i not in waiting]
        step = 0
        while keep:
            if len(keep) < len(live):
                idx = torch.tensor(keep)
                cache.batch_select_indices(idx)
                last_NV, attn_NP = last_NV[idx], attn_NP[idx]
                live = [live[k] for k in keep]
            if step > 0:  # feed the previous step's tokens
                tok_N1 = torch.tensor([[results[i]["output_ids"][-1]] for i in live])
                pos_N1 = torch.tensor([[len(prompts[i]) + step - 1] for i in live])
                attn_NP = torch.cat([attn_NP, torch.ones(len(live), 1, dtype=torch.long)], dim=1)
                out = self.model(input_ids=tok_N1, attention_mask=attn_NP, position_ids=pos_N1,
                                 past_key_values=cache, use_cache=True)
                cache, last_NV = out.past_key_values, out.logits[:, -1].float()
            # Aborts the scheduler received before this token: the row still samples it, then finishes.
            to_finish = set() if stream is None else stream.aborts([rows[i] for i in live])
            logits_NV = self._ban_early_stops(last_NV, [sps[i] for i in live], step)
            tokens, logprobs = self._sample(logits_NV, [sps[i] for i in live], [len(prompts[i]) + step for i in live])
            keep = []
            for k, (i, token, logprob) in enumerate(zip(live, tokens, logprobs)):
                res = results[i]
                res["output_ids"].append(token)
                res["output_logprobs"].append(logprob)
                finished = True
                if rows[i] in to_finish:  # Req.update_finish_state: to_finish comes first
                    res["finish_reason"] = dict(_ABORTED)
                # As Req.check_finished: the length limit is tested before the stop tokens, so a stop
                # token at the limit finishes as "length".
                elif len(res["output_ids"]) >= sps[i]["max_new_tokens"]:
                    pass
                else:
                    matched = token if token in stop_ids[i] else self._matched_stop_str(res["output_ids"], sps[i])
                    if matched is not None:
                        res["finish_reason"] = {"type": "stop", "matched": matched}
                    else:
                        keep.append(k)
                        finished = False
                if stream is not None:
                    stream.emit(rows[i], res, finished)
            if stream is not None:
                stream.step_done()
            step += 1
        return results

    def _ban_early_stops(self, logits_NV: torch.Tensor, sps: List[Dict[str, Any]], step: int) -> torch.Tensor:
        """BatchedMinNewTokensPenalizer: while a row has fewer than min_new_tokens outputs, its stop ids
        (stop_token_ids, the config's and the tokenizer's eos; ignore_eos does not matter) get -inf added
        to the logits, before the sampler: the draw and the returned logprob both see the ban."""
        rows = [k for k, sp in enumerate(sps) if step < sp["min_new_tokens"]]
        if not rows:
            return logits_NV
        logits_NV = logits_NV.clone()
        for k in rows:
            logits_NV[k, sorted(set(sps[k]["stop_token_ids"]) | self.eos_ids)] = float("-inf")
        return logits_NV

    def _input_logprobs(self, prompt: List[int], logp_PV: torch.Tensor, start: int) -> list:
        # Prompt logprobs are always at T = 1 (note 1.5). Like SGLang, the first returned
        # entry is padded with None and the entries cover prompt[start:].
        if start < 0:
            start = len(prompt) - 1
        out = []
        for k in range(start, len(prompt)):
            lp = None if k == start else float(logp_PV[k - 1, prompt[k]])
            out.append((lp, prompt[k], None))
        return out

    def _sample(self, logits_NV: torch.Tensor, sps: List[Dict[str, Any]],
                positions: List[int]) -> Tuple[List[int], List[float]]:
        """One token per row, and its logprob log_softmax(logits / T) before any filtering."""
        # Greedy (top_k = 1): argmax, logprob at T = 1, as SGLang's all-greedy branch.
        greedy = [sp["top_k"] == 1 for sp in sps]
        temp_N1 = torch.tensor([[1.0 if g else sp["temperature"]] for g, sp in zip(greedy, sps)])
        logp_NV = torch.log_softmax(logits_NV / temp_N1, dim=-1)
        tokens = logits_NV.argmax(-1)
        rows = [k for k, g in enumerate(greedy) if not g]
        if rows:
            sampled = [sps[k] for k in rows]
            probs_RV = self._filtered_probs(logp_NV[rows].exp(), *(
                torch.tensor([sp[key] for sp in sampled]) for key in ("top_k", "top_p", "min_p")))
            if self.deterministic:
                # With deterministic inference the draw depends only on (seed, position), so the
                # n samples of one prompt come out identical (note 7).
                for r, k in enumerate(rows):
                    seed = sps[k]["sampling_seed"] if sps[k]["sampling_seed"] is not None else DEFAULT_SAMPLING_SEED
                    gen = torch.Generator().manual_seed(hash((int(seed), positions[k])) & 0x7FFFFFFFFFFFFFFF)
                    gumbel_V = -torch.log(-torch.log(torch.rand(probs_RV.shape[1], generator=gen).clamp_min(1e-20)))
                    tokens[k] = torch.argmax(torch.log(probs_RV[r]) + gumbel_V)
            else:
                tokens[rows] = torch.multinomial(probs_RV, 1, generator=self.rng)[:, 0]
        logprobs = logp_NV.gather(-1, tokens[:, None])[:, 0]
        return tokens.tolist(), logprobs.tolist()

    @staticmethod
    def _filtered_probs(probs_NV: torch.Tensor, top_k_N: torch.Tensor, top_p_N: torch.Tensor,
                        min_p_N: torch.Tensor) -> torch.Tensor:
        """Zero the tokens outside top-k (-1: all), the top-p nucleus and the min-p floor (unnormalised)."""
        sorted_NV, order_NV = torch.sort(probs_NV, dim=-1, descending=True)
        rank_V = torch.arange(probs_NV.shape[-1])
        keep_NV = (top_k_N[:, None] < 1) | (rank_V < top_k_N[:, None])
        # Drop a token once the mass strictly before it exceeds top_p; the first always stays.
        keep_NV &= (torch.cumsum(sorted_NV, -1) - sorted_NV) <= top_p_N[:, None]
        keep_NV &= sorted_NV >= sorted_NV[:, :1] * min_p_N[:, None]
        return torch.zeros_like(probs_NV).scatter(-1, order_NV, sorted_NV * keep_NV)

    def _matched_stop_str(self, output_ids: List[int], sp: Dict[str, Any]) -> Optional[str]:
        if not sp["stop"] or self.tokenizer is None:
            return None  # without a tokenizer stop strings cannot match (skip_tokenizer_init)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=sp["skip_special_tokens"])
        return next((s for s in sp["stop"] if s in text), None)
