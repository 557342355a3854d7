"""One TP rank's model: load it, decode for real, load weights by name.

Every rank holds the full model (a real rank holds a shard of it); the engine checks
that all ranks produce identical outputs, which holds exactly when their weights match.

Legend: P prompt tokens, V vocab.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from sglang.srt.sampling.sampling_params import DEFAULT_SAMPLING_SEED

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
    def generate_one(self, prompt: List[int], sp: Dict[str, Any], return_logprob: bool,
                     logprob_start_len: int) -> Dict[str, Any]:
        """Decode one sequence with a KV cache; logprobs as SGLang's sampler reports them."""
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
        logits_PV = out.logits[0].float()
        cache = out.past_key_values
        res: Dict[str, Any] = {"output_ids": [], "output_logprobs": [], "input_logprobs": None}
        if return_logprob:
            res["input_logprobs"] = self._input_logprobs(prompt, logits_PV, logprob_start_len)
        stop_ids = set() if sp["ignore_eos"] else set(sp["stop_token_ids"]) | self.eos_ids
        last_V = logits_PV[-1]
        finish = {"type": "length", "length": sp["max_new_tokens"]}
        for step in range(sp["max_new_tokens"]):
            token, logprob = self._sample(last_V, sp, position=len(prompt) + step)
            res["output_ids"].append(token)
            res["output_logprobs"].append(logprob)
            if token in stop_ids:
                finish = {"type": "stop", "matched": token}
                break
            matched = self._matched_stop_str(res["output_ids"], sp)
            if matched is not None:
                finish = {"type": "stop", "matched": matched}
                break
            if step + 1 < sp["max_new_tokens"]:
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache, last_V = out.past_key_values, out.logits[0, -1].float()
        res["finish_reason"] = finish
        return res

    def _input_logprobs(self, prompt: List[int], logits_PV: torch.Tensor, start: int) -> list:
        # Prompt logprobs are always at T = 1 (note 1.5). Like SGLang, the first returned
        # entry is padded with None and the entries cover prompt[start:].
        if start < 0:
            start = len(prompt) - 1
        logp_PV = torch.log_softmax(logits_PV, dim=-1)
        out = []
        for k in range(start, len(prompt)):
            lp = None if k == start else float(logp_PV[k - 1, prompt[k]])
            out.append((lp, prompt[k], None))
        return out

    def _sample(self, logits_V: torch.Tensor, sp: Dict[str, Any], position: int) -> Tuple[int, float]:
        if sp["top_k"] == 1:
            # Greedy: argmax, logprob of log_softmax(logits) (T = 1), as SGLang's all-greedy branch.
            token = int(torch.argmax(logits_V))
            return token, float(torch.log_softmax(logits_V, dim=-1)[token])
        scaled_V = logits_V / sp["temperature"]
        logp_V = torch.log_softmax(scaled_V, dim=-1)  # the reported logprob: before any filtering
        probs_V = self._filtered_probs(logp_V.exp(), sp["top_k"], sp["top_p"], sp["min_p"])
        if self.deterministic:
            # With deterministic inference the draw depends only on (seed, position), so the
            # n samples of one prompt come out identical (note 7).
            seed = sp["sampling_seed"] if sp["sampling_seed"] is not None else DEFAULT_SAMPLING_SEED
            gen = torch.Generator().manual_seed(hash((int(seed), position)) & 0x7FFFFFFFFFFFFFFF)
            gumbel_V = -torch.log(-torch.log(torch.rand(probs_V.shape, generator=gen).clamp_min(1e-20)))
            token = int(torch.argmax(torch.log(probs_V) + gumbel_V))
        else:
            token = int(torch.multinomial(probs_V, 1, generator=self.rng))
        return token, float(logp_V[token])

    @staticmethod
    def _filtered_probs(probs_V: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
        """Zero the tokens outside top-k, the top-p nucleus and the min-p floor (unnormalised)."""
        sorted_V, order_V = torch.sort(probs_V, descending=True)
        keep_V = torch.ones_like(sorted_V, dtype=torch.bool)
        if top_k > 0:
            keep_V[top_k:] = False
        # Drop a token once the mass strictly before it exceeds top_p; the first always stays.
        keep_V &= (torch.cumsum(sorted_V, 0) - sorted_V) <= top_p
        if min_p > 0:
            keep_V &= sorted_V >= sorted_V[0] * min_p
        out_V = torch.zeros_like(probs_V)
        out_V[order_V[keep_V]] = sorted_V[keep_V]
        return out_V

    def _matched_stop_str(self, output_ids: List[int], sp: Dict[str, Any]) -> Optional[str]:
        if not sp["stop"] or self.tokenizer is None:
            return None  # without a tokenizer stop strings cannot match (skip_tokenizer_init)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=sp["skip_special_tokens"])
        return next((s for s in sp["stop"] if s in text), None)
