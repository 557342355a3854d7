"""What starting vLLM does to the trainer's process and device, without starting an engine: the random
streams it reseeds (restored by ProcessGuard), and the gpu_memory_utilization its CUDA start-up check needs.

vLLM's worker refuses to start unless free device memory >= gpu_memory_utilization x total (default 0.92),
even with kv_cache_memory_bytes set; the trainer's shards are already resident then, so the adapter must
pass a fraction the free memory admits (v1/worker/utils.py request_memory).
"""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable")

GIB = 1 << 30


def test_process_guard_gives_back_the_random_streams_vllm_reseeds():
    from vllm.utils.torch_utils import set_random_seed

    from hybrid_rl.rollout.vllm.setup import ProcessGuard

    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)
    with ProcessGuard():
        set_random_seed(0)  # what vLLM's worker does at start, with rollout.seed
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == (want[0].tolist(), want[1], want[2])


def test_cuda_memory_utilization_fits_what_is_free():
    from hybrid_rl.rollout.vllm.setup import START_MARGIN_BYTES, cuda_memory_utilization

    total = 80 * GIB
    # 7B recipe: ~9 GB resident when the engine starts -> vLLM's default 0.92 would be refused.
    free = 71 * GIB
    u = cuda_memory_utilization(None, 20 * GIB, free, total)
    assert u == pytest.approx((free - START_MARGIN_BYTES) / total) and u * total <= free
    assert cuda_memory_utilization(None, 20 * GIB, 79.9 * GIB, total) == 0.92  # never above vLLM's default
    assert cuda_memory_utilization(0.6, 0, free, total) == 0.6
    with pytest.raises(ValueError, match="rollout.mem_fraction.*use at most 0.88"):
        cuda_memory_utilization(0.9, 0, free, total)
    with pytest.raises(ValueError, match="rollout.kv_cache_bytes"):
        cuda_memory_utilization(None, 75 * GIB, free, total)


def test_engine_start_on_cuda_passes_a_utilization_the_free_memory_admits(monkeypatch):
    import vllm

    from hybrid_rl.rollout.vllm.engine import VLLMEngine

    seen = {}

    class Spy:
        def __init__(self, **kw):
            seen.update(kw)
            # what the adapter reads back after the start: the runner it pinned for CUDA (V2)
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=True))

    monkeypatch.setattr(vllm, "LLM", Spy)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (71 * GIB, 80 * GIB))
    eng = VLLMEngine.__new__(VLLMEngine)  # only what _start reads
    eng.device, eng.tp_size, eng.dtype, eng.kv_bytes = torch.device("cuda", 0), 1, torch.bfloat16, 8 * GIB
    eng._start("/nonexistent", 1024, 64, None, False, 0, {})
    assert seen["kv_cache_memory_bytes"] == 8 * GIB and seen["dtype"] == "bfloat16"
    assert seen["gpu_memory_utilization"] * 80 * GIB <= 71 * GIB


@pytest.mark.parametrize(
    "value, expected", [(None, {}), (False, {"enforce_eager": False}), (True, {"enforce_eager": True})]
)
def test_enforce_eager_reaches_the_engine_only_when_set(monkeypatch, value, expected):
    """Catches: rollout.enforce_eager dropped on its way to vllm.LLM (the benchmark's --vllm-compile would then
    compare an eager engine with TRL's compiled one), or a null overriding vLLM's per-device default."""
    from types import SimpleNamespace

    import hybrid_rl.rollout.vllm.engine as V
    from hybrid_rl.config.load import load_config

    seen = {}
    monkeypatch.setattr(V, "VLLMEngine", lambda *a, **kw: seen.update(kw))
    cfg = load_config(None, [] if value is None else [f"rollout.enforce_eager={str(value).lower()}"])
    V.build_for_trainer(cfg, torch.nn.Linear(1, 1), SimpleNamespace(pad_token_id=0, eos_token_id=1), 4, False, None)
    assert seen["engine_kwargs"] == expected
