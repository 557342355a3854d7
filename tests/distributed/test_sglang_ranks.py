"""The SGLang adapter on 2 real torchrun ranks against the CPU stand-in, tp_size 1 and 2:
every rank gets exactly its own completions, equal to the native engine's on the same
weights; every SGLang TP rank opens exactly its own payloads; the sync re-sends everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_each_rank_gets_its_own_completions_from_the_group_engine(tiny_model_dir, tmp_path, tp_size):
    from hybrid_rl.runtime.distributed import free_port

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "fake_sglang"), ROOT])}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, "sglang_ranks_main.py"),
        tiny_model_dir,
        str(tp_size),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for r, res in enumerate(ranks):
        assert res["step0"] == res["native"] == res["step1"], f"rank {r}: greedy must equal the native engine's"
        for got, want in zip(res["logprobs0"], res["native_logprobs"]):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
        assert len(res["sampled0"]) == 16
        stats = res["sync_stats"]
        assert stats["bytes"] == tp_size * res["n_params_bytes"], "each TP rank receives the whole model once"
        if tp_size == 2 or r == 1:  # rank 1's bad prompt fails its group's call, on every rank of the group
            assert res["bad_generate"].startswith("SGLang generate failed: ValueError"), res["bad_generate"]
        else:
            assert res["bad_generate"] == "no error"
    assert ranks[0]["step0"] != ranks[1]["step0"], "the ranks asked for different prompts"
    owners = [res for res in ranks if res["is_owner"]]
    assert len(owners) == 2 // tp_size
    for res in owners:
        debug = res["debug"]["ranks"]
        assert len(debug) == tp_size
        buckets = res["sync_stats"]["payloads"] // tp_size
        for d in debug:
            # Two syncs (one per step), one payload per bucket per sync, each opened once.
            assert d["payloads_opened"] == 2 * buckets, d
            assert d["all_params_loaded_since_release"]
