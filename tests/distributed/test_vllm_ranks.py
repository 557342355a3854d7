"""The vLLM adapter on 2 real torchrun ranks (external_launcher), tp_size 1 and 2: every rank gets exactly
its own completions, in order, equal to the native engine's greedy output on the same weights; the
trainer's LOCAL_WORLD_SIZE and process group survive the engine. Skipped only where vllm is not importable."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.engine_helpers import vllm_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> str:
    return vllm_model_dir(tmp_path_factory, "vllm_model")


@pytest.mark.parametrize("tp_size", [1, 2])
def test_each_rank_gets_its_own_completions(wide_model_dir, tmp_path, tp_size):
    from hybrid_rl.runtime.distributed import free_port

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, "vllm_ranks_main.py"),
        wide_model_dir,
        str(tp_size),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for r, res in enumerate(ranks):
        assert len(res["step0"]) == 3 + r, "each rank gets as many completions as it asked for"
        assert res["step0"] == res["native"] == res["step1"], f"rank {r}: greedy must equal the native engine's"
        for got, want in zip(res["logprobs0"], res["native_logprobs"]):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert len(res["sampled0"]) == 2 * (3 + r)
        assert res["sync_bytes"] == res["n_params_bytes"], "every rank hands vLLM the whole model once per sync"
        assert res["local_world_size"] == "2", "vLLM's LOCAL_WORLD_SIZE=tp_size must not outlive its start"
    assert ranks[0]["step0"][0] != ranks[1]["step0"][0], "the ranks asked for different prompts"
