"""Adapter-only weight sync into SGLang (LoRA, issue 29): the LoRA part of rollout/sglang.py's SGLangEngine.

What SGLang 0.5.21 offers (read in its source; shared/notes/sglang-api.md section 9):
  * `Engine(enable_lora=True, max_lora_rank=r, lora_target_modules=[...])`: without adapters given at start,
    both the rank and the targets must be named; `max_loras_per_batch` slots of the rank are reserved.
  * `load_lora_adapter_from_tensors(lora_name, tensors, config_dict, load_format)`: in memory, with the same
    per-TP-rank payloads as a weight update (`flattened_bucket`: one per rank, each rank opens its own);
    peft names (`base_model.model.<module>.lora_A.weight`), A (r, in), B (out, r), any float dtype (cast into
    the engine's buffers); scaling lora_alpha / r. It answers a record with `.success` / `.error_message`
    (a refused load does not kill the engine). A name already loaded is refused, so each push gets a new
    name (`policy-v<k>`), and the previous one is unloaded after it (`unload_lora_adapter`).
  * `generate(..., lora_path=[name] * N)`: the adapter for those requests; None is the base. Every load gets
    a fresh internal id that the prefix cache keys on: no KV of an older adapter is reused.
  * Release: the adapters live outside the memory saver's "weights" region and survive it; the base does
    not, unless the engine keeps a host copy (`enable_weights_cpu_backup=True`, one host copy of the base per
    engine). With it the base is sent once (PhaseManager asks `base_synced`), and each step sends only the
    adapter: rank x (in + out) per adapted Linear, in the engine's dtype.
If an SGLang lacks `load_lora_adapter_from_tensors` (0.5.17 was not read), the first sync says so; there is no
merged-weights fallback.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from hybrid_rl import distributed as D
from hybrid_rl.rollout.sglang_calls import attempt, uninterrupted, unwrap
from hybrid_rl.rollout.weight_transport import push_bucket

# SGLang 0.5.21's SUPPORTED_LORA_TARGET_MODULES (srt/utils/common.py), the names of dense models' Linears.
SGLANG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj", "lm_head")
MAX_LORAS_PER_BATCH = 2  # one adapter is served at a time; a spare slot (SGLang counts the base as one too)
NAME = "policy"


def check_targets(targets) -> None:
    """Refuse target module names SGLang cannot adapt (before a model is built; `all-linear` passes)."""
    if isinstance(targets, str):
        return
    bad = sorted({t.split(".")[-1] for t in targets} - set(SGLANG_LORA_TARGETS))
    if bad:
        raise ValueError(f"config key 'model.lora.target_modules': SGLang 0.5.21 adapts only {list(SGLANG_LORA_TARGETS)}"
                         f", not {bad}; choose from those or use rollout.engine=vllm or native")


def lora_spec(model: torch.nn.Module) -> Optional[dict]:
    """rank, alpha, adapted Linears' leaf names and peft name -> shape of the policy's adapter; None without one."""
    from hybrid_rl.models.lora import ADAPTER, lora_layers, peft_name

    layers = lora_layers(model)
    if not layers:
        return None
    rank = layers[0].r[ADAPTER]
    alpha = layers[0].lora_alpha[ADAPTER]
    for layer in layers:
        if layer.r[ADAPTER] != rank or abs(layer.scaling[ADAPTER] - alpha / rank) > 1e-12:
            raise ValueError("config key 'model.lora.rank': SGLang serves one rank per adapter, scaled by alpha / rank "
                             "(no rsLoRA, no per-layer ranks)")
    names = {m: n for n, m in model.named_modules()}
    targets = sorted({names[layer].rsplit(".", 1)[-1] for layer in layers})
    check_targets(targets)
    shapes = {peft_name(n): tuple(p.shape) for n, p in model.named_parameters() if peft_name(n)}
    return {"rank": rank, "alpha": alpha, "targets": targets, "shapes": shapes,
            "config": {"r": rank, "lora_alpha": alpha, "target_modules": targets}}  # what LoRAConfig reads


class SGLangLoraMixin:
    """LoRA for SGLangEngine: engine arguments, `base_synced`, `update_adapter`, the lora_path of generate."""

    lora: Optional[dict] = None
    base_complete = False  # a complete base sync ended since start (set by SGLangEngine.end_weight_update)
    adapter_name: Optional[str] = None

    def start_lora(self, model: torch.nn.Module) -> None:
        self.lora = lora_spec(model)
        self.adapter_version = 0

    def lora_engine_args(self) -> dict:
        """Engine keywords for serving the policy's adapter (empty without LoRA); they override engine_kwargs."""
        if self.lora is None:
            return {}
        return {"enable_lora": True, "max_lora_rank": self.lora["rank"], "lora_target_modules": self.lora["targets"],
                "max_loras_per_batch": MAX_LORAS_PER_BATCH, "enable_weights_cpu_backup": True}

    @property
    def base_synced(self) -> bool:
        """The engine holds the whole base: the host copy keeps it across releases once a full sync ended."""
        return self.lora is not None and self.base_complete

    def lora_paths(self, n: int) -> Optional[list]:
        """generate's lora_path for n prompts: the pushed adapter's name for each, or None (no LoRA: the base)."""
        if self.lora is None:
            return None
        if self.adapter_name is None:
            raise RuntimeError("no adapter loaded into SGLang yet; the phase switch's sync (update_adapter) comes first")
        return [self.adapter_name] * n

    @uninterrupted
    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> int:
        """Every rank of the group passes the whole adapter (peft names, full tensors, the same order); the owner
        loads it under a new name and unloads the previous one. Returns the adapter's bytes (one copy)."""
        if self.lora is None:
            raise RuntimeError("this SGLang engine was built for a policy without LoRA adapters; build it from the "
                               "peft-injected policy (model.lora.rank > 0)")
        if "weights" in self.released or self.session:
            raise RuntimeError("update_adapter() needs resumed weights and no open weight-update session")
        if (config.get("r"), config.get("lora_alpha")) != (self.lora["rank"], self.lora["alpha"]):
            raise ValueError(f"adapter config r={config.get('r')} lora_alpha={config.get('lora_alpha')} differs from the "
                             f"engine's start ({self.lora['rank']}, {self.lora['alpha']})")
        bucket = list(named_tensors)
        self._check_adapter(bucket)
        name = f"{NAME}-v{self.adapter_version + 1}"
        from hybrid_rl.rollout.sglang import check_payloads

        nbytes = push_bucket(bucket, self.dtype, self.owner, self.group, lambda payloads: self._lora_call(
            "load_lora_adapter_from_tensors", name, payloads, self.lora["config"], load_format="flattened_bucket",
            precheck=lambda: check_payloads(payloads, self.tp_size)))
        old, self.adapter_name, self.adapter_version = self.adapter_name, name, self.adapter_version + 1
        if old is not None:
            self._lora_call("unload_lora_adapter", old)
        self.sync_stats["bytes"] += nbytes * self.tp_size
        self.sync_stats["payloads"] += self.tp_size
        return nbytes

    def _check_adapter(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """SGLang drops unknown names and zeroes what is missing without a word, and finds a wrong shape only when
        a batch uses the adapter (a scheduler failure: fatal). So the whole adapter, exactly, is checked here."""
        shapes = self.lora["shapes"]
        got = {n: tuple(t.shape) for n, t in bucket}
        if set(got) != set(shapes):
            extra, missing = sorted(set(got) - set(shapes)), sorted(set(shapes) - set(got))
            raise ValueError(f"adapter sync must carry exactly the policy's {len(shapes)} LoRA tensors (peft names); "
                             f"unknown {extra[:3]}, missing {missing[:3]}")
        wrong = [n for n in got if got[n] != shapes[n]]
        if wrong:
            raise ValueError(f"adapter tensor {wrong[0]}: shape {got[wrong[0]]} != the policy's {shapes[wrong[0]]}")
        if any(not t.dtype.is_floating_point for _, t in bucket):
            raise TypeError("adapter tensors must be floating point")

    def _lora_call(self, method: str, *args, precheck=None, **kwargs) -> None:
        """engine.method(...) on the owner; its LoRAUpdateOutput's refusal is an error on every rank of the group."""
        outcome = None
        if self.is_owner:
            def call():
                fn = getattr(self.engine, method, None)
                if fn is None:
                    raise RuntimeError(f"this SGLang has no {method} (0.5.21 has it); use rollout.engine=vllm or native "
                                       "with model.lora.rank > 0, or model.lora.rank=0")
                if precheck is not None:
                    precheck()
                out = self._calls.run(fn, *args, **kwargs)
                return bool(out.success), str(out.error_message or "")
            outcome = attempt(call)
        ok, msg = unwrap(D.broadcast_object_from(outcome, self.owner, self.group), method)
        if not ok:
            raise RuntimeError(f"SGLang {method}({args[0]!r}) refused: {msg}")
