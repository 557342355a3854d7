"""The Engine's LoRA methods (note section 9): the TokenizerManager side of 0.5.21's adapter API.

`load_lora_adapter_from_tensors(lora_name, tensors, config_dict, load_format=None)`: tensors is a
dict (serialized once per TP rank here, in the caller) or, with load_format="flattened_bucket", one
pre-serialized `{"flattened_tensor", "metadata"}` payload per TP rank. Every TP rank opens its own
payload, and the load succeeds only if every rank's does. `unload_lora_adapter(lora_name)`. Both
return a `LoRAUpdateOutput`, never raise for a refused load. Each load gets a fresh lora_id (a uuid4,
as LoRARef does), so the prefix cache never mixes two adapters' KV. generate(lora_path=...) resolves
names here: LoRA off, a name never loaded, or one loaded and then unloaded (its implicit reload
from the placeholder path "__tensor__" fails) are ValueErrors, and nothing runs.
"""
from __future__ import annotations

import uuid
from typing import Dict, List, Optional

from sglang.srt.entrypoints.sync_api import _sync_api
from sglang.srt.lora.lora_manager import parse_lora_paths
from sglang.srt.managers.io_struct import LoRAUpdateOutput
from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads

_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoraEngineMixin:
    _lora_registry: Dict[str, str]  # name -> lora_id of the loaded adapters
    _lora_ever_loaded: set  # lora_ref_cache: every name loaded since start

    def _lora_init(self, a: dict) -> None:
        self._lora_enabled = bool(a["enable_lora"])
        self._lora_registry, self._lora_ever_loaded = {}, set()

    @_sync_api
    def load_lora_adapter_from_tensors(self, lora_name: str, tensors, config_dict: Dict,
                                       load_format: Optional[str] = None) -> LoRAUpdateOutput:
        self._client.check_alive()
        tp = len(self._client.conns)
        if load_format == "flattened_bucket":
            payloads = normalize_serialized_named_tensor_payloads(tensors)
        else:
            payloads = [MultiprocessingSerializer.serialize(tensors) for _ in range(tp)]
        if not self._lora_enabled:
            return LoRAUpdateOutput(success=False, error_message=_NOT_ENABLED)
        lora_id = uuid.uuid4().hex
        replies = self._client.call("lora_load", (payloads, load_format, lora_name, lora_id, dict(config_dict)))
        result = _merge(replies)
        if result.success:
            self._lora_registry[lora_name] = lora_id
            self._lora_ever_loaded.add(lora_name)
        return result

    @_sync_api
    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        self._client.check_alive()
        if not self._lora_enabled:
            return LoRAUpdateOutput(success=False, error_message=_NOT_ENABLED)
        lora_id = self._lora_registry.pop(lora_name, None)
        if lora_id is None:
            return LoRAUpdateOutput(success=False, error_message=(
                f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {list(self._lora_registry)}"))
        return _merge(self._client.call("lora_unload", lora_id))

    def _lora_ids(self, lora_path, num: int) -> List[Optional[str]]:
        """TokenizerManager._validate_and_resolve_lora: one lora_id (or None: the base) per prompt."""
        names = parse_lora_paths(lora_path, num)
        if any(n is not None for n in names) and not self._lora_enabled:
            raise ValueError(f"LoRA adapter '{next(n for n in names if n)}' was requested, but LoRA is not enabled. "
                             "Please launch the server with --enable-lora flag and preload adapters "
                             "using --lora-paths or /load_lora_adapter endpoint.")
        for name in names:
            if name is None or name in self._lora_registry:
                continue
            if name not in self._lora_ever_loaded:
                raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                 f"All loaded adapters: {sorted(self._lora_ever_loaded)}.")
            raise ValueError(f"Failed to implicitly load LoRA adapter {name}: its path is '__tensor__' "
                             "(loaded from tensors, then unloaded)")
        return [None if n is None else self._lora_registry[n] for n in names]


def _merge(replies: List[dict]) -> LoRAUpdateOutput:
    """_merge_lora_update_results: success only if every rank succeeded."""
    failed = [r for r in replies if not r["success"]]
    if not failed:
        return LoRAUpdateOutput(success=True, loaded_adapters=replies[0]["loaded_adapters"])
    msgs = list(dict.fromkeys(r["error_message"] for r in failed if r["error_message"]))
    return LoRAUpdateOutput(success=False, error_message=" | ".join(msgs), loaded_adapters=failed[0]["loaded_adapters"])
