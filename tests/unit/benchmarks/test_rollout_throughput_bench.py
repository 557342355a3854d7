"""benchmarks/rollout_throughput.py: the roofline's byte count by hand, and the script end to end on CPU.

No timing assertions: the GPU numbers (decode tokens/s, fraction of the HBM roofline) come from
this script, so what is checked here is that it runs, reports every case, and counts bytes right.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH_DIR)  # the script imports phase_swap as a sibling, as when run directly
    try:
        spec = importlib.util.spec_from_file_location(
            "rollout_throughput_bench", os.path.join(BENCH_DIR, "rollout_throughput.py")
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(BENCH_DIR)


def test_useful_bytes_reads_the_weights_once_and_each_running_rows_own_kv(bench):
    from hybrid_rl.types import Completion

    model = bench.build_model("tiny", 64, torch.float32, torch.device("cpu"), 32)
    cfg = model.config
    weights = sum(p.numel() for p in model.parameters()) * 4  # tied: the head is the embedding
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    comps = [Completion([7] * n, [0.0] * n, "length") for n in (3, 1, 2)]
    nbytes, steps = bench.useful_bytes(model, comps, [5, 4, 6], 4)
    # Token 0 comes from the prefill. Step 1 feeds token 0 of the rows with a token 1 (rows 0 and 2),
    # which attend to their prompt + 1 tokens; step 2 feeds row 0's token 1 over 5 + 2 tokens.
    assert steps == 2
    assert nbytes == 2 * weights + ((5 + 1) + (6 + 1) + (5 + 2)) * kv_token


@pytest.mark.slow
def test_script_reports_every_case_on_cpu(bench, capsys):
    T, N = 6, 4
    res = bench.main(
        [
            "--models",
            "tiny",
            "--new-tokens",
            str(T),
            "--batch",
            str(N),
            "--prompt-len",
            "8",
            "--vocab",
            "64",
            "--scenarios",
            "full,ragged",
            "--paths",
            "old,new",
            "--device",
            "cpu",
        ]
    )
    rows = {(r["scenario"], r["path"]): r for r in res["results"]}
    assert set(rows) == {(s, p) for s in ("full", "ragged") for p in ("old", "new")}
    for (scen, path), r in rows.items():
        assert r["greedy_old_eq_new"], "the old and new decode loops must agree on greedy tokens"
        assert 0 < r["tokens"] <= N * T and r["longest"] <= T
        if scen == "full":  # no stop token: every row generates T tokens on both paths
            assert r["tokens"] == N * T
        assert r["decode_tokens_per_s"] > 0 and r["roofline_frac"] is None  # the roofline is GPU-only
    assert rows[("full", "new")]["decode_path"] == "lean"
    assert set(res["speedup_new_over_old"]) == {f"tiny/N={N}/T={T}/full", f"tiny/N={N}/T={T}/ragged"}
    assert res["graphs_over_lean"] == {} and all(r["batch"] == N for r in rows.values())
    # No vllm path asked for: no vLLM column (its rows are tested in test_vllm_benchmarks.py).
    assert res["vllm_over_new_with_prefill"] == {} and all(r["greedy_native_eq_vllm"] is None for r in rows.values())
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith('{"benchmark": "rollout_throughput"')


@pytest.mark.slow
def test_lean_against_graphs_at_several_batch_sizes(bench):
    """What benchmarks/gpu_session.sh asks at the 1.5B shape (`--batch 64,512 --paths lean,new`), tiny on CPU: a
    case per batch size, the lean path with graphs off, and the graphs-over-lean ratio per case.
    Catches: cases of two batch sizes merged under one key."""
    res = bench.main(
        ["--models", "tiny", "--new-tokens", "4", "--batch", "2,3", "--prompt-len", "6", "--vocab", "64"]
        + ["--scenarios", "full", "--paths", "lean,new", "--device", "cpu"]
    )
    assert [(r["batch"], r["path"]) for r in res["results"]] == [(2, "lean"), (2, "new"), (3, "lean"), (3, "new")]
    assert all(r["tokens"] == r["batch"] * 4 for r in res["results"])
    assert set(res["graphs_over_lean"]) == {"tiny/N=2/T=4/full", "tiny/N=3/T=4/full"}


def test_the_lean_path_is_the_engine_with_graphs_off(bench, monkeypatch):
    """Catches: the lean path built with CUDA graphs left to the engine (on CUDA it would compare graphs with
    graphs; on CPU both decode eagerly, so only the engine's arguments show it)."""

    class Built(Exception):
        pass

    def spy(*args, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(bench, "NativeEngine", spy)
    with pytest.raises(Built) as lean:
        bench.run_case(None, "lean", [], None, -1, torch.device("cpu"), 1)
    with pytest.raises(Built) as graphs:
        bench.run_case(None, "new", [], None, -1, torch.device("cpu"), 1)
    assert (lean.value.args[0]["cuda_graphs"], graphs.value.args[0]["cuda_graphs"]) == (False, None)
