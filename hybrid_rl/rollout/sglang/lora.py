"""Adapter-only weight sync into SGLang (LoRA, issue 29): what SGLang can serve, and the adapter's spec.

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

from typing import Optional

import torch

# SGLang 0.5.21's SUPPORTED_LORA_TARGET_MODULES (srt/utils/common.py), the names of dense models' Linears.
SGLANG_LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "lm_head",
)
MAX_LORAS_PER_BATCH = 2  # one adapter is served at a time; a spare slot (SGLang counts the base as one too)
NAME = "policy"


def check_targets(targets) -> None:
    """Refuse target module names SGLang cannot adapt (before a model is built; `all-linear` passes)."""
    if isinstance(targets, str):
        return
    bad = sorted({t.split(".")[-1] for t in targets} - set(SGLANG_LORA_TARGETS))
    if bad:
        raise ValueError(
            f"config key 'model.lora.target_modules': SGLang 0.5.21 adapts only {list(SGLANG_LORA_TARGETS)}"
            f", not {bad}; choose from those or use rollout.engine=vllm or native"
        )


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
            raise ValueError(
                "config key 'model.lora.rank': SGLang serves one rank per adapter, scaled by alpha / rank "
                "(no rsLoRA, no per-layer ranks)"
            )
    names = {m: n for n, m in model.named_modules()}
    targets = sorted({names[layer].rsplit(".", 1)[-1] for layer in layers})
    check_targets(targets)
    shapes = {peft_name(n): tuple(p.shape) for n, p in model.named_parameters() if peft_name(n)}
    return {
        "rank": rank,
        "alpha": alpha,
        "targets": targets,
        "shapes": shapes,
        "config": {"r": rank, "lora_alpha": alpha, "target_modules": targets},
    }  # what LoRAConfig reads
