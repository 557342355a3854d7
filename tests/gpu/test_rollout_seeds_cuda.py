"""The vLLM engine's sampling seeds on CUDA, where vLLM runs Model Runner V2 (rollout/vllm/setup.py
`request_seeds`): a seed repeats its samples whatever NumPy's global stream holds. Skipped without CUDA or
without vLLM (the GPU image has none); no node id here names that package, since CI fails a skipped test that
does (tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the engine's package"),
]


def test_a_seed_repeats_its_samples_on_the_cuda_runner(tmp_path_factory):
    """Without per-request seeds V2 draws each request's seed from NumPy's global generator, so reseeding NumPy
    between two calls with the same seed would change the samples."""
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.vllm.engine import VLLMEngine
    from hybrid_rl.switch.phases import PhaseManager
    from hybrid_rl.types import SamplingParams
    from tests.engine_helpers import PROMPTS, vllm_model_dir

    model_dir = vllm_model_dir(tmp_path_factory, "seeds_cuda")
    dev = torch.device("cuda")
    tok = load_tokenizer(model_dir)
    policy = load_causal_lm(model_dir).to(dev)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    engine = VLLMEngine(
        policy, model_dir, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, max_model_len=64, sequences=32
    )
    try:
        assert engine.llm.llm_engine.vllm_config.use_v2_model_runner, "the adapter pins V2 on CUDA"
        pm = PhaseManager(policy, opt, engine, dev)

        def sample(seed: int, numpy_seed: int) -> list[list[int]]:
            np.random.seed(numpy_seed)
            with pm.rollout() as e:
                out = e.generate(PROMPTS * 4, SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed))
            with pm.train():
                pass
            return [c.token_ids for c in out]

        first = sample(21, numpy_seed=0)
        assert sample(21, numpy_seed=1) == first, "a seed must repeat its samples whatever NumPy's stream holds"
        assert sample(22, numpy_seed=0) != first, "another seed draws other samples"
    finally:
        engine.shutdown()
