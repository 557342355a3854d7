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

How it plugs in (the wiring left for after the config / trainer / planner reshaping lands):
* config: `ModelConfig.lora: LoraSettings = field(default_factory=LoraSettings)`; `Config` checks call
  `check_model_dir(cfg.model.lora, cfg.model.path)` before any model is built (it builds the model on
  the meta device from config.json only), and `check_engine(cfg.model.lora, cfg.rollout.engine)`.
* trainer `_build_models`: with `lora.enabled`, `load_sharded(..., load=lambda: apply_lora(
  load_causal_lm(path, dtype, attn), lora), prepare=[lambda m: (prepare_policy(m, gc), apply_lora(m,
  lora))])`, i.e. dropout off BEFORE the injection (prepare_policy would zero peft's lora_dropout
  too), rank 0's adapter init broadcast to every rank; no reference model is built: reference scoring
  runs `with adapters_disabled(policy): ...`. `_build_optimizer`: `trainable_parameters(policy)` only.
* sync (switch/weights.py / rollout/vllm.py): the first sync after the engine starts sends
  `base_named_parameters(policy)` (HF names, `.base_layer.` removed, adapters left out); every sync
  sends `adapter_named_tensors(policy, engine_dtype)` through `rollout/vllm_lora.py`'s
  `AdapterPush`; the metrics' sync bytes are `adapter_bytes(policy, dtype)`.
* planner: `adapter_numel(target_shapes(...), rank)` for the adapters' weights, grads and Adam state.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's adapter name; one adapter per policy
_LORA_PARAM = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")


@dataclass
class LoraSettings:
    """`model.lora.*`. rank 0 = LoRA off (the whole policy trains)."""

    rank: int = 0
    alpha: float = 32.0  # peft's lora_alpha: the update is scaled by alpha / rank
    # Applied in the update only (train mode); scoring runs in eval mode, so a non-zero value biases the
    # PPO ratio the way model dropout would (models/fsdp.py prepare_policy). verl's default is 0.
    dropout: float = 0.0
    target_modules: Union[str, list[str]] = ALL_LINEAR  # "all-linear" (every Linear but the LM head) or names

    def __post_init__(self) -> None:
        _check(isinstance(self.rank, int) and self.rank >= 0, "rank", f"must be an integer >= 0 (0 = off), got {self.rank!r}")
        _check(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha!r}")
        _check(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout!r}")
        tm = self.target_modules
        if isinstance(tm, str):
            _check(tm == ALL_LINEAR, "target_modules", f"a string must be {ALL_LINEAR!r}; got {tm!r} (give a list of "
                   "module names, e.g. [q_proj, v_proj])")
        else:
            tm = list(tm)
            _check(len(tm) > 0 and all(isinstance(t, str) and t for t in tm), "target_modules",
                   f"must be {ALL_LINEAR!r} or a non-empty list of module names, got {tm!r}")
            _check(len(set(tm)) == len(tm), "target_modules", f"lists a name twice: {tm!r}")
            self.target_modules = tm

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, bias="none")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key 'model.lora.{key}': {msg}")


# -- checks before (and while) a model is built ---------------------------------------------------
def linear_layers(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of every plain `nn.Linear` (a meta-device model will do)."""
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules()
            if type(m) is torch.nn.Linear and not n.endswith(".base_layer")}


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
                _check(False, "target_modules", f"{entry!r} matches no linear layer of the model; its linear layers "
                       f"are named {ends}")
            out.update(hits)
    _check(bool(out), "target_modules", "selects no linear layer of the model")
    for name, (fan_in, fan_out) in out.items():
        _check(settings.rank <= min(fan_in, fan_out), "rank",
               f"{settings.rank} is larger than the width of {name} (in {fan_in}, out {fan_out}): a rank above "
               f"min(in, out) = {min(fan_in, fan_out)} adds parameters and no expressiveness; lower it")
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
            "merge_and_unload, then save_pretrained) and point model.path there")
    if not settings.enabled:
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face model directory (config key 'model.path')")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return target_shapes(settings, meta)


def check_engine(settings: LoraSettings, engine: str) -> None:
    """The rollout engines that serve adapters: native (the live module) and vLLM (its LoRA API, rank in
    vLLM's allowed max_lora_rank values). SGLang: see shared/notes/sglang-api.md (not wired yet)."""
    if not settings.enabled:
        return
    if engine == "vllm":
        from hybrid_rl.rollout.vllm_lora import max_lora_rank

        max_lora_rank(settings.rank)  # raises for a rank vLLM cannot serve
        return
    if engine != "native":
        raise ValueError(f"config key 'model.lora.rank': rollout.engine={engine!r} has no adapter sync in this "
                         "library yet; use rollout.engine=native or vllm, or model.lora.rank=0")


# -- the adapted policy ---------------------------------------------------------------------------
def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


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
    inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER)
    cast_adapter_dtype(model, adapter_name=ADAPTER, autocast_adapter_dtype=True)  # fp32 masters over a bf16 base
    for name, p in model.named_parameters():
        assert p.requires_grad == bool(_LORA_PARAM.match(name)), f"{name}: peft left the trainable set wrong"
    return model


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
        raise RuntimeError("adapters_disabled on a model without LoRA adapters: with model.lora.rank=0 the "
                           "reference is its own model")
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


def adapter_named_tensors(model: torch.nn.Module, dtype: Optional[torch.dtype] = None
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full tensor) of every adapter weight, each shard cast to `dtype` (None: as stored, fp32) before
    the all-gather, as switch/weights.py does for full weights. A collective under FSDP2: every rank iterates to
    the end, in the same order. lora_A is (rank, in), lora_B is (out, rank)."""
    from hybrid_rl.switch.weights import full_tensor

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
