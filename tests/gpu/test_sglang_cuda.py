"""The SGLang engine on a real GPU with real SGLang (skipped unless CUDA and `sglang` import).

Run on a GPU machine with SGLang installed (sglang 0.5.17 on torch 2.11, 0.5.21 on torch
2.13): `pytest tests/gpu/test_sglang_cuda.py`. The CPU stand-in never gets here: the engine
tests skip when the importable `sglang` is the one under tests/fake_sglang. The allocator
test needs CUDA only (it runs in benchmarks/gpu_session.sh, whose image has no SGLang).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch


def _real_sglang() -> bool:
    spec = importlib.util.find_spec("sglang")
    return spec is not None and "fake_sglang" not in (spec.origin or "")


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_sglang = pytest.mark.skipif(not _real_sglang(), reason="needs a real sglang")
PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14]]


@pytest.fixture(scope="module")
def sglang_model_dir(tmp_path_factory) -> str:
    """The tiny word-level Qwen2 at head_dim 64 (hidden 128, 2 heads, 1 KV head): SGLang's CUDA
    attention backends (FA3 on Hopper, FlashInfer) have kernels for head dims such as 64, 128
    and 256, not for the conftest model's 16."""
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(
        str(tmp_path_factory.mktemp("sglang_model") / "model"),
        DIGIT_WORDS,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
    )


@pytest.fixture(scope="module")
def setup(sglang_model_dir):
    if not _real_sglang():
        pytest.skip("needs a real sglang")
    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.sglang.engine import SGLangEngine
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.switch.phases import PhaseManager

    dev = D.init("cuda")
    tok = load_tokenizer(sglang_model_dir)
    policy = shard_model(load_causal_lm(sglang_model_dir), dev, mixed_precision=True)
    engine = SGLangEngine(
        policy,
        sglang_model_dir,
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
        weights_dtype=torch.bfloat16,
        mem_fraction=0.3,
    )
    pm = PhaseManager(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), engine, dev)
    yield policy, engine, pm, tok
    engine.shutdown()


def _greedy_rollout(pm):
    from hybrid_rl.types import SamplingParams

    with pm.rollout() as engine:
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, greedy=True))
    with pm.train():
        pass
    return out


def test_greedy_after_a_sync_equals_the_native_engine(setup):
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.types import SamplingParams

    policy, engine, pm, tok = setup
    got = _greedy_rollout(pm)
    native = NativeEngine(policy, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, weights_dtype=torch.bfloat16)
    native.resume(["weights", "kv_cache"])
    want = native.generate(PROMPTS, SamplingParams(max_new_tokens=8, greedy=True))
    native.release(["kv_cache", "weights"])
    # bf16 kernels differ between engines: compare the first tokens, where ties are unlikely.
    assert [c.token_ids[:3] for c in got] == [c.token_ids[:3] for c in want]


def test_release_frees_the_engine_memory_and_resume_sync_reproduces(setup):
    policy, engine, pm, _ = setup
    first = [c.token_ids for c in _greedy_rollout(pm)]
    free_released = torch.cuda.mem_get_info()[0]
    engine.resume(["weights"])
    engine.resume(["kv_cache"])
    torch.cuda.synchronize()
    held = free_released - torch.cuda.mem_get_info()[0]
    engine.release(["kv_cache", "weights"])
    torch.cuda.synchronize()
    freed = torch.cuda.mem_get_info()[0] - (free_released - held)
    assert held > 0 and freed >= 0.9 * held, f"release gave back {freed} of {held} bytes"
    assert [c.token_ids for c in _greedy_rollout(pm)] == first, "release, resume and sync give the same output"


@needs_sglang
def test_five_grpo_steps_on_one_gpu(sglang_model_dir, tmp_path):
    from hybrid_rl import Trainer, load_config

    cfg = load_config(
        None,
        [
            f"model.path={sglang_model_dir}",
            f"trainer.out_dir={tmp_path}",
            "trainer.device=cuda",
            "rollout.engine=sglang",
            "rollout.mem_fraction=0.3",
            "trainer.total_steps=5",
            "trainer.progress_bar=false",
            "data.batch_size=8",
            "rollout.n=4",
            "rollout.max_new_tokens=4",
        ],
    )
    trainer = Trainer(cfg)
    history = trainer.fit()
    trainer.close()
    assert len(history) == 5 and all(math.isfinite(h["actor/loss"]) for h in history)
    assert all(h["rollout/logp_mismatch"] < 0.1 for h in history), "bf16 engines agree closely"
    assert os.path.isfile(tmp_path / "metrics.jsonl")


_EXPORT_UNDER_EXPANDABLE = """
import torch
from hybrid_rl.rollout.sglang import alloc_conf as A

def expandable(t):
    seg = [s for s in torch.cuda.memory_snapshot() if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]]
    return seg[0].get("is_expandable")

settings = A.current_settings()
assert A.expandable_segments(settings), f"torch did not read the variable: {settings!r}"
trainer = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")  # stays: its segment has room left
assert expandable(trainer) is True
A.apply_settings(A.ipc_safe(settings))
bucket = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
assert expandable(bucket) is False, "an export buffer made inside the session is in an expandable segment"
torch.multiprocessing.reductions.reduce_tensor(bucket)  # the CUDA IPC export the adapter makes
A.apply_settings(settings)
assert A.expandable_segments(A.current_settings())
after = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
assert expandable(after) is True, "the trainer's settings were not restored"
print("ok")
"""


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_an_export_switches_expandable_segments_off_under_either_variable(name):
    """torch reads PYTORCH_ALLOC_CONF first, then PYTORCH_CUDA_ALLOC_CONF (alloc_conf.py): under
    either, the allocator starts with expandable segments, an export session's settings put new
    memory in plain segments (CUDA IPC cannot share expandable ones), and the restore brings them back.
    A fresh process per variable: torch reads it once, at its first CUDA allocation."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
    }
    env[name] = "max_split_size_mb:512,expandable_segments:True"
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT_UNDER_EXPANDABLE], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
