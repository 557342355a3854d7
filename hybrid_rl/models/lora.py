"""LoRA through peft: the settings (`model.lora.*`), their checks before a model is built, the adapters
injected into the policy, the reference as the policy with its adapters off, and the adapter-only state
a sync sends.

Design. peft's LoRA tuner is injected IN PLACE (`peft.inject_adapter_in_model`, the tuner
`get_peft_model` builds, without the `PeftModel` wrapper around it): the policy stays the transformers
`*ForCausalLM`, so everything that reads `model.model.layers`, `model.config` or parameter names
(FSDP2 wrapping in models/fsdp.py, `load_sharded`'s meta build + broadcast, logprobs, the native
engine, checkpoints) works unchanged. Each adapted `nn.Linear` becomes a peft `lora.Linear` holding
`base_layer` (frozen, in the model's dtype: bf16 on CUDA) and `lora_A/lora_B` (trainable, cast to fp32
by peft's `cast_adapter_dtype`: the fp32 masters). Parameter names gain `.base_layer.` and
`.lora_{A,B}.default.`; the names a peft adapter directory and vLLM use are `adapter_named_tensors`'.

Where it plugs in: the settings are config/schema.py's (schema), checked in loop/preflight.py
(`check_engine`, `check_model_dir`: before any weight is read); the trainer builds the policy with
`policy_loading` (dropout off BEFORE the injection, rank 0's adapter init broadcast to every rank), gives AdamW
`trainable_parameters` only and scores the reference `with adapters_disabled(policy)` (no second copy);
switch/phases.py syncs an engine with its own copy adapter-only (`base_named_parameters` once, then
`adapter_named_tensors` each step, through `update_adapter`: rollout/vllm/lora.py, rollout/sglang/lora.py);
checkpoint/sharded.py saves the trainable parameters only;
checkpoint/export.py writes the adapter directory or the merged model; the planner counts the adapters with
plan.arch.lora_param_count.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from typing import Callable, Iterator, Optional

import torch

from hybrid_rl.config.schema import LORA_ALL_LINEAR as ALL_LINEAR
from hybrid_rl.config.schema import LoraSettings

ADAPTER = "default"  # peft's adapter name; one adapter per policy
_LORA_PARAM = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")


def peft_config(settings: LoraSettings):
    """peft's LoraConfig for `settings` (bias off: only lora_A / lora_B train)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        bias="none",
    )


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key 'model.lora.{key}': {msg}")


# -- checks before (and while) a model is built ---------------------------------------------------
def linear_layers(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of every plain `nn.Linear` (a meta-device model will do)."""
    return {
        n: (m.in_features, m.out_features)
        for n, m in model.named_modules()
        if type(m) is torch.nn.Linear and not n.endswith(".base_layer")
    }


def target_shapes(settings: LoraSettings, model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The layers `settings` adapts, name -> (in, out), matched as peft matches a list (a name equal to the
    entry or ending in '.' + entry); "all-linear" is every Linear but the output embedding, as in peft.
    Raises a config error for an entry that matches no Linear and for a rank above a layer's width."""
    linears = linear_layers(model)
    if settings.target_modules == ALL_LINEAR:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        out = {n: s for n, s in linears.items() if not (head is not None and model.get_submodule(n) is head)}
    else:
        out = {}
        for entry in settings.target_modules:
            hits = {n: s for n, s in linears.items() if n == entry or n.endswith("." + entry)}
            if not hits:
                ends = sorted({n.rsplit(".", 1)[-1] for n in linears})
                _check(
                    False,
                    "target_modules",
                    f"{entry!r} matches no linear layer of the model; its linear layers are named {ends}",
                )
            out.update(hits)
    _check(bool(out), "target_modules", "selects no linear layer of the model")
    for name, (fan_in, fan_out) in out.items():
        _check(
            settings.rank <= min(fan_in, fan_out),
            "rank",
            f"{settings.rank} is larger than the width of {name} (in {fan_in}, out {fan_out}): a rank above "
            f"min(in, out) = {min(fan_in, fan_out)} adds parameters and no expressiveness; lower it",
        )
    return out


def check_model_dir(settings: LoraSettings, path: str) -> Optional[dict[str, tuple[int, int]]]:
    """Refuse a peft adapter directory as `model.path`, and check `settings` against the model's layers,
    built on the meta device from config.json alone (no weights read). Returns the target shapes, or None
    when LoRA is off."""
    adapter_cfg = os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter_cfg):
        with open(adapter_cfg) as f:
            base = json.load(f).get("base_model_name_or_path")
        raise ValueError(
            f"config key 'model.path': {path!r} is a peft adapter directory (adapter_config.json), not a model. "
            f"Set model.path to its base model ({base!r} by its adapter_config.json) and train a new adapter with "
            "model.lora.rank; to continue from this adapter, merge it into the base first (peft's "
            "merge_and_unload, then save_pretrained) and point model.path there"
        )
    if not settings.enabled:
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path!r} has no config.json: not a Hugging Face model directory (config key 'model.path')"
        )
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return target_shapes(settings, meta)


# -- the adapted policy ---------------------------------------------------------------------------
def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The peft LoRA layers of `model` ([] for a model without adapters). peft is read from sys.modules, never
    imported: only peft can inject these layers, so where it was never imported there are none, and an engine
    asking a LoRA-free policy (SGLang's start, model.lora.rank=0) must run where peft is not installed."""
    tuners = sys.modules.get("peft.tuners.lora")
    if tuners is None:
        return []
    return [m for m in model.modules() if isinstance(m, tuners.LoraLayer)]


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Inject peft LoRA layers into `model` in place (base frozen, adapters trainable, adapters fp32 whatever
    the base dtype). Idempotent: a model that already has them is returned as it is (load_sharded runs its
    prepare functions on the loaded model too, on one rank). Returns `model`."""
    if not settings.enabled:
        return model
    if lora_layers(model):
        return model
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype

    target_shapes(settings, model)
    inject_adapter_in_model(peft_config(settings), model, adapter_name=ADAPTER)
    cast_adapter_dtype(model, adapter_name=ADAPTER, autocast_adapter_dtype=True)  # fp32 masters over a bf16 base
    for name, p in model.named_parameters():
        assert p.requires_grad == bool(_LORA_PARAM.match(name)), f"{name}: peft left the trainable set wrong"
    return model


def policy_loading(
    model_cfg, as_policy: Callable[[torch.nn.Module], object], mixed_precision: bool
) -> tuple[Optional[Callable[[], torch.nn.Module]], Callable[[torch.nn.Module], object], torch.dtype]:
    """(load, prepare, dtype) for `models.fsdp.load_sharded` to build the policy of `model_cfg` (config.model).

    Without LoRA: the default load, `as_policy`, fp32 (the masters). With it: the base in the inference dtype
    (bf16 under mixed precision: it never trains, so it needs no fp32 master) and `as_policy` (dropout off,
    checkpointing) run BEFORE the injection, so peft's own lora_dropout keeps `lora.dropout`. Rank 0's load
    injects too: its adapter init is what every rank receives (apply_lora is idempotent on the loaded model)."""
    settings = model_cfg.lora
    if not settings.enabled:
        return None, as_policy, torch.float32
    from hybrid_rl.models.loading import load_causal_lm

    dtype = torch.bfloat16 if mixed_precision else torch.float32

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        if not lora_layers(model):  # once: again on the loaded model, it would zero peft's lora_dropout
            as_policy(model)
        return apply_lora(model, settings)

    return (lambda: prepare(load_causal_lm(model_cfg.path, dtype, model_cfg.attn_implementation))), prepare, dtype


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer gets: with LoRA the adapters only, so Adam's state exists for them alone."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The reference: the policy with every adapter off (peft's `enable_adapters(False)` on each LoRA layer,
    what `PeftModel.disable_adapter` does), so its outputs are the base model's to the bit. peft also
    clears the adapters' requires_grad while off; each flag is put back as it was."""
    layers = lora_layers(model)
    if not layers:
        raise RuntimeError(
            "adapters_disabled on a model without LoRA adapters: with model.lora.rank=0 the reference is its own model"
        )
    was_off = [layer.disable_adapters for layer in layers]
    flags = [(p, p.requires_grad) for n, p in model.named_parameters() if _LORA_PARAM.match(n)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer, off in zip(layers, was_off):
            layer.enable_adapters(not off)
        for p, flag in flags:
            p.requires_grad_(flag)


# -- what a sync sends ----------------------------------------------------------------------------
def peft_name(param_name: str) -> Optional[str]:
    """The name peft's adapter file and vLLM use for an adapter parameter ('base_model.model.<module>.lora_A.weight'),
    or None for a base parameter."""
    m = _LORA_PARAM.match(param_name)
    if m is None or m["adapter"] != ADAPTER:
        return None
    return f"base_model.model.{m['module']}.lora_{m['ab']}.weight"


def adapter_named_tensors(
    model: torch.nn.Module, dtype: Optional[torch.dtype] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full tensor) of every adapter weight, each shard cast to `dtype` (None: as stored, fp32) before
    the all-gather, as models/weights.py does for full weights. A collective under FSDP2: every rank iterates to
    the end, in the same order. lora_A is (rank, in), lora_B is (out, rank)."""
    from hybrid_rl.models.weights import full_tensor

    for name, p in model.named_parameters():
        out = peft_name(name)
        if out is None:
            continue
        t = p.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        yield out, full_tensor(t)


def base_named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(HF name, parameter) of the frozen base: the names of the model before the injection ('.base_layer.'
    removed), adapters left out. What the engine's one full sync sends (vLLM's reload takes these names)."""
    for name, p in model.named_parameters():
        if _LORA_PARAM.match(name):
            continue
        yield name.replace(".base_layer.", "."), p


def adapter_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of one adapter sync in `dtype`, from the parameters' (global) shapes: no collective."""
    return sum(p.shape.numel() for n, p in model.named_parameters() if peft_name(n)) * dtype.itemsize


def adapter_numel(shapes: dict[str, tuple[int, int]], rank: int) -> int:
    """Adapter parameters for target layers name -> (in, out): rank x (in + out) each (A: rank x in, B: out x rank)."""
    return sum(rank * (fan_in + fan_out) for fan_in, fan_out in shapes.values())


def adapter_config(model: torch.nn.Module) -> dict:
    """The adapter_config.json of the injected adapter (peft's own dict; sets as sorted lists), which vLLM's
    PEFTHelper reads for rank, alpha and target modules."""
    cfg = getattr(model, "peft_config", {}).get(ADAPTER)
    if cfg is None:
        raise RuntimeError("the model has no injected LoRA adapter (apply_lora first)")
    out = cfg.to_dict()
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in out.items()}


def save_adapter_dir(model: torch.nn.Module, path: str, dtype: Optional[torch.dtype] = None) -> int:
    """Write the adapter as a peft adapter directory (adapter_config.json + adapter_model.safetensors), the format
    `PeftModel.from_pretrained` and vLLM's LoRARequest(lora_path=...) read. A collective under FSDP2 (every rank
    calls; rank 0 alone need write, the caller decides). Returns the tensor bytes written."""
    from safetensors.torch import save_file

    tensors = {n: t.contiguous() for n, t in adapter_named_tensors(model, dtype)}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(model), f, indent=2, default=str)
    return sum(t.numel() * t.element_size() for t in tensors.values())
