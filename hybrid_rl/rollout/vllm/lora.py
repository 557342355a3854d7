"""Adapter-only weight sync into an in-process vLLM 0.32 engine (LoRA, issue 29).

vLLM's public LoRA route reads a directory: `LoRARequest(lora_name, lora_int_id, lora_path)` has no field for
tensors, and its worker loads every new adapter with `LoRAModel.from_local_checkpoint(lora_path, ...)`
(lora/worker_manager.py `_load_adapter`). The engine here lives in the trainer's own process, so the push skips
the file: it builds the `LoRAModel` from the tensors with vLLM's own `LoRAModel.from_lora_tensors` and the
`PEFTHelper` of the adapter's config (what `_load_adapter` does after reading the file), then replaces the
adapter in the worker's LRU manager (remove, add, activate: `LRUCacheWorkerLoRAManager.add_adapter`'s
`load_inplace` sequence). Requests then carry `request`, whose id is already registered, so vLLM never opens
its path (the LRU manager only touches a registered id). The directory route (peft's format, written by
`models.lora.save_adapter_dir`) is the fallback and is tested to give the same tokens.

The base goes in once (the engine's ordinary full sync, `models.lora.base_named_parameters`); each step
pushes only the adapter. Sleep: on CUDA `sleep(level=1)` keeps the base (offloaded to host with the LoRA slot
buffers, both allocated under the "weights" tag) and restores both at wake; level 2 discards both, so with
LoRA the engine must sleep at level 1 (rollout/vllm/engine.py uses 2 today: a hook). On CPU sleep frees nothing.
A push after every wake re-writes the slots anyway (remove + activate), whatever the level.

What rollout/vllm/engine.py needs for this (not wired yet): `engine_kwargs(rank)` merged into `LLM(...)`; the
`expected` names from `base_named_parameters` (not the peft module's names); SLEEP_LEVEL 1 when LoRA is on,
and the base synced only when `synced` is False (first sync, or after a level-2 wake); `generate` passing
`lora_request=self.adapter.request`; `update_adapter(named_tensors, config)` calling `AdapterPush.push`
and counting its bytes in `sync_stats`.
"""

from __future__ import annotations

from typing import Iterable

import torch

# vllm/config/lora.py: `MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]`
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
IN_MEMORY_PATH = "in-memory:hybrid_rl"  # never opened: the id is registered before any request carries it


def max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM 0.32 accepts that holds `rank` (its slot buffers are sized by it)."""
    fits = [r for r in VLLM_MAX_LORA_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(
            f"config key 'model.lora.rank': vLLM 0.32 serves LoRA ranks 1..{VLLM_MAX_LORA_RANKS[-1]}, "
            f"got {rank}; lower it or use rollout.engine=native"
        )
    return fits[0]


def engine_kwargs(rank: int) -> dict:
    """What `vllm.LLM(...)` needs to serve one adapter of `rank` (fp32 or the engine's dtype: lora_dtype 'auto')."""
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(rank), "max_loras": 1}


class AdapterPush:
    """Pushes the policy's adapter into `llm`'s LoRA manager, in memory (module docstring)."""

    def __init__(self, llm, name: str = "policy", lora_id: int = 1):
        self.llm, self.name, self.lora_id = llm, name, lora_id
        self.version = 0  # pushes so far; 0 = the engine has no adapter yet
        self.last_bytes = 0

    @property
    def _manager(self):
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        manager = getattr(runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("the vLLM engine was started without LoRA; start it with engine_kwargs(rank)")
        return manager

    @property
    def request(self):
        """The LoRARequest every generate call passes while the adapter is on."""
        if self.version == 0:
            raise RuntimeError("no adapter pushed yet; push() before generating with it")
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_id, lora_path=IN_MEMORY_PATH)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> int:
        """Replace the adapter with `named_tensors` (peft names, full tensors: every TP rank passes the whole
        adapter and vLLM slices it) under `config` (its adapter_config.json dict). Returns the bytes pushed."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        worker_manager = self._manager
        manager = worker_manager._adapter_manager
        # Copies: vLLM folds the scaling into lora_B IN PLACE (LoRALayerWeights.optimize, `lora_b *= scaling`, from
        # LoRAModelManager._add_adapter), and from_lora_tensors' `.to(cpu, dtype)` returns the same tensor when
        # nothing changes: without the copy a CPU fp32 policy's own lora_B would be scaled by alpha / rank each push.
        tensors = {n: t.detach().clone() for n, t in named_tensors}
        self._check_modules(manager, tensors)
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings}
        )
        helper.validate_legal(worker_manager.lora_config)  # rank <= max_lora_rank, no DoRA / bias
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=self.lora_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=worker_manager.lora_config.lora_dtype,
            model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        manager.remove_adapter(self.lora_id)  # deactivates: activate below re-writes the slot buffers
        manager.add_adapter(lora)
        manager.activate_adapter(self.lora_id)
        self.version += 1
        self.last_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return self.last_bytes

    @staticmethod
    def _check_modules(manager, tensors: dict) -> None:
        """vLLM checks the module names of a directory's adapter and ignores unknown ones in memory: a misnamed
        tensor (or a base weight) would be dropped without a word. Refused here instead."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        expected = set()
        for module in manager.supported_lora_modules:
            expected.update(manager.packed_modules_mapping.get(module, [module]))
        bad = []
        for name in tensors:
            try:
                module, _ = parse_fine_tuned_lora_name(name)
            except ValueError:
                bad.append(name)
                continue
            if module.rsplit(".", 1)[-1] not in expected:
                bad.append(name)
        if bad:
            raise ValueError(
                f"{len(bad)} tensors are not LoRA weights of a module vLLM adapts (e.g. {bad[:3]}); "
                f"it adapts {sorted(expected)}; send models.lora.adapter_named_tensors only"
            )
