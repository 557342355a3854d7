"""LoRA for the stand-in (note section 9): the server-argument checks, and one TP rank's adapters.

What it reproduces of 0.5.21 (`lora/lora_manager.py`, `lora/mem_pool.py`, `lora/utils.py`,
`arg_groups/lora_hook.py`):
* enable_lora without lora_paths needs max_lora_rank and lora_target_modules (an assert at start);
  "all" must stand alone; target names are normalised (q/k/v_proj -> qkv_proj, gate/up_proj ->
  gate_up_proj) before an adapter's targets are compared with the server's.
* a load fails (success=False, not a crash) for a name already loaded, a rank over max_lora_rank,
  targets outside lora_target_modules, DoRA, or a config without r / lora_alpha / target_modules.
* tensor names are peft's (`base_model.model.<module>.lora_A.weight`, A (r, in), B (out, r)); a name
  whose module is not a target is skipped; a targeted module the adapter leaves out adds nothing.
* the adapter is applied per request, unmerged: out = base(x) + (lora_alpha / r) * (x A^T) B^T, in
  the model's dtype; a wrong A/B shape is found only when a batch uses the adapter (fatal there).
* adapters live outside the memory saver's "weights" region: release/resume never touches them.
Stand-in judgment (unverified): target names outside SGLang's CLI choices are refused at start;
lora_paths, max_loaded_loras (LRU eviction) and pinned adapters are not implemented.
"""
from __future__ import annotations

import contextlib
import hashlib
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

# srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES, the dense-model names.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                     "gate_up_proj", "embed_tokens", "lm_head")
_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj"}
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def normalized(targets) -> set:
    if isinstance(targets, str):
        if targets not in ("all", "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    return {_STACKED.get(t.split(".")[-1], t.split(".")[-1]) for t in targets}


def check_lora_server_args(a: Dict[str, Any]) -> None:
    """What check_lora_server_args asserts when the Engine is built."""
    assert a["max_loras_per_batch"] > 0, "max_loras_per_batch must be positive"
    for key in ("lora_paths", "max_loaded_loras"):
        if a[key] is not None:
            raise NotImplementedError(f"the sglang stand-in does not implement {key}")
    if not a["enable_lora"]:
        return
    targets = a["lora_target_modules"]
    assert a["max_lora_rank"] and targets, (
        "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
        "--lora-target-modules for LoRA initialization.")
    if "all" in targets:
        assert len(targets) == 1, "If 'all' is specified in --lora-target-modules, it should be the only module specified."
    bad = sorted(set(targets) - set(SUPPORTED_TARGETS) - {"all"})
    if bad:
        raise ValueError(f"lora_target_modules {bad} are not among SGLang's choices {list(SUPPORTED_TARGETS)}")


class LoRAManager:
    """One TP rank's adapters, by lora_id; `applied(lora_id)` adapts the model for one batch."""

    def __init__(self, args: Dict[str, Any], model: torch.nn.Module):
        self.model, self.max_rank = model, args["max_lora_rank"]
        targets = args["lora_target_modules"]
        self.targets = normalized(_LINEARS) if "all" in targets else normalized(targets)
        self.modules = dict(model.named_modules())
        self.adapters: Dict[str, Dict[str, Any]] = {}  # lora_id -> {name, scaling, weights: module -> {A, B}}
        self.stats = {"lora_loads": 0, "lora_tensors_skipped": 0, "lora_tensor_bytes": 0}

    def loaded(self) -> Dict[str, str]:
        return {a["name"]: "__tensor__" for a in self.adapters.values()}

    def load(self, lora_id: str, name: str, config: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> dict:
        try:
            r, alpha, targets = config["r"], config["lora_alpha"], config["target_modules"]
            if config.get("use_dora", False):
                raise ValueError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
            if any(a["name"] == name for a in self.adapters.values()):
                raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
            wanted = normalized(targets)
            if r > self.max_rank or not ("all" in wanted or wanted <= self.targets):
                raise ValueError(
                    f"LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
            weights = self._parse(tensors)
        except Exception as err:  # noqa: BLE001 - LoRAManager returns every load failure as success=False
            return {"success": False, "error_message": str(err), "loaded_adapters": self.loaded()}
        self.adapters[lora_id] = {"name": name, "r": r, "scaling": alpha / r, "weights": weights}
        self.stats["lora_loads"] += 1
        return {"success": True, "error_message": None, "loaded_adapters": self.loaded()}

    def _parse(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
        weights: Dict[str, Dict[str, torch.Tensor]] = {}
        for tname, t in tensors.items():
            m = _NAME.match(tname)
            module = m["module"] if m else None
            if module is None or module not in self.modules or normalized([module]) - self.targets:
                self.stats["lora_tensors_skipped"] += 1  # the real loader drops or skips it with a warning
                continue
            weights.setdefault(module, {})[m["ab"]] = t.detach().cpu().clone()  # host copy, as LoRAAdapter keeps
            self.stats["lora_tensor_bytes"] += t.nbytes
        return weights

    def unload(self, lora_id: str) -> dict:
        self.adapters.pop(lora_id, None)
        return {"success": True, "error_message": None, "loaded_adapters": self.loaded()}

    def digest(self) -> str:
        h = hashlib.sha256()
        for lora_id in sorted(self.adapters):
            for module, ab in sorted(self.adapters[lora_id]["weights"].items()):
                for key in sorted(ab):
                    h.update(f"{module}.{key}".encode())
                    h.update(ab[key].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    @contextlib.contextmanager
    def applied(self, lora_id: Optional[str]) -> Iterator[None]:
        """Adapt the targeted Linears with `lora_id`'s weights for one batch (None: the base)."""
        if lora_id is None:
            yield
            return
        adapter = self.adapters[lora_id]
        hooks = []
        try:
            for module, ab in adapter["weights"].items():
                hooks.append(self.modules[module].register_forward_hook(self._hook(module, ab, adapter)))
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _hook(self, module: str, ab: Dict[str, torch.Tensor], adapter: Dict[str, Any]):
        layer, r, scaling = self.modules[module], adapter["r"], adapter["scaling"]
        dtype = layer.weight.dtype
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            return lambda _mod, _inp, out: out  # a missing half leaves a zeroed buffer: no update
        # mem_pool.load_lora_weight_to_buffer asserts the shapes when a batch first uses the adapter.
        assert tuple(a.shape) == (r, layer.in_features) and tuple(b.shape) == (layer.out_features, r), (
            f"LoRA buffer shape does not match weight shape: {module} A {tuple(a.shape)} B {tuple(b.shape)}")
        a, b = a.to(dtype), b.to(dtype)

        def hook(_mod, inputs: Tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            return out + scaling * ((inputs[0] @ a.T) @ b.T)

        return hook


def parse_lora_paths(lora_path, num: int) -> List[Optional[str]]:
    """GenerateReqInput._normalize_lora_paths: a str for every prompt, or a list with one entry per prompt."""
    if lora_path is None:
        return [None] * num
    if isinstance(lora_path, str):
        return [lora_path] * num
    if isinstance(lora_path, list):
        if len(lora_path) != num:
            raise ValueError(f"lora_path list length ({len(lora_path)}) must match batch size ({num})")
        return list(lora_path)
    raise ValueError("lora_path should be a list or a string.")
