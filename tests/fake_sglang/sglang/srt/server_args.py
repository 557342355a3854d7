"""ServerArgs: the Engine's keyword arguments (`srt/server_args.py`, note 1.1-1.2).

The real record is a msgspec Struct: an unknown keyword or a missing `model_path`
is a TypeError, and the record is sealed once built. The stand-in knows the 0.5.21
names an RL adapter plausibly passes; a name outside this list is refused even if
the real record has it, so extend the list (with the real default) when needed.
"""
from __future__ import annotations

from typing import Any, Dict

_DEFAULTS: Dict[str, Any] = {
    # model and loading
    "model_path": None, "tokenizer_path": None, "tokenizer_mode": "auto", "skip_tokenizer_init": False,
    "load_format": "auto", "trust_remote_code": False, "dtype": "auto", "kv_cache_dtype": "auto",
    "context_length": None, "revision": None, "quantization": None, "served_model_name": None,
    "device": None, "random_seed": None, "weight_version": "default", "model_impl": "auto",
    # parallelism and placement
    "tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1, "base_gpu_id": 0, "gpu_id_step": 1,
    "nnodes": 1, "node_rank": 0, "dist_init_addr": None, "dist_timeout": None,
    "enable_dp_attention": False, "enable_p2p_check": False,
    # memory
    "mem_fraction_static": None, "max_running_requests": None, "max_total_tokens": None,
    "chunked_prefill_size": None, "max_prefill_tokens": 16384, "enable_memory_saver": False,
    "enable_weights_cpu_backup": False, "enable_draft_weights_cpu_backup": False,
    "disable_radix_cache": False,
    # kernels and graphs
    "attention_backend": None, "sampling_backend": None, "disable_cuda_graph": False,
    "cuda_graph_max_bs": None, "cuda_graph_bs": None, "cuda_graph_backend_decode": None,
    "cuda_graph_backend_prefill": None, "enable_torch_compile": False, "disable_overlap_schedule": False,
    "triton_attention_num_kv_splits": 8, "schedule_policy": "fcfs",
    # LoRA (arg_groups/fields/lora.py)
    "enable_lora": None, "max_lora_rank": None, "lora_target_modules": None, "lora_paths": None,
    "max_loaded_loras": None, "max_loras_per_batch": 8, "lora_backend": "csgmv", "lora_strict_loading": False,
    # determinism and RL
    "enable_deterministic_inference": False, "rl_on_policy_target": None,
    # serving and process control
    "host": "127.0.0.1", "port": 30000, "nccl_port": None, "log_level": "error", "log_level_http": None,
    "skip_server_warmup": False, "watchdog_timeout": 300, "custom_sigquit_handler": None,
    "stream_output": False, "enable_metrics": False, "show_time_cost": False,
    # streaming (arg_groups/fields/serving.py)
    "stream_interval": 1, "incremental_streaming_output": False,
}

_REQUIRED = ("model_path",)


class ServerArgs:
    """Attribute record of the Engine's settings; setattr after construction raises."""

    def __init__(self, **kwargs: Any):
        for name in kwargs:
            if name not in _DEFAULTS:
                raise TypeError(f"Unexpected keyword argument {name!r}")
        for name in _REQUIRED:
            if kwargs.get(name) is None:
                raise TypeError(f"Missing required argument {name!r}")
        values = {**_DEFAULTS, **kwargs}
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ServerArgs is sealed after construction; cannot set {name!r}")

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__["_values"])

    @staticmethod
    def field_names() -> list:
        return list(_DEFAULTS)
