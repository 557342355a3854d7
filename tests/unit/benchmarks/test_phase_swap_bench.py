"""benchmarks/phase_swap.py on a tiny model: every stage reported, byte counts consistent.

No timing assertions (machines are noisy): only that the numbers exist, are finite,
and that the bytes each stage claims to move match the model and optimizer sizes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "benchmarks", "phase_swap.py")
# One thread: a 64-wide model is all overhead, and two threads on a busy 2-core machine
# spend most of their time waiting for each other.
TINY = [
    "--hidden",
    "64",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--vocab",
    "128",
    "--batch",
    "2",
    "--prompt-len",
    "8",
    "--new-tokens",
    "4",
    "--train-tokens",
    "8",
    "--threads",
    "1",
]
ALWAYS = (
    "zero_grad",
    "offload_optimizer",
    "resume_weights",
    "resume_kv",
    "kv_prefill",
    "release_engine",
    "onload_ref",
    "offload_ref",
    "onload_optimizer",
)
COPIED = ("offload_optimizer", "onload_optimizer", "onload_ref", "offload_ref")


def _load_bench():
    spec = importlib.util.spec_from_file_location("phase_swap_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load_bench()


@pytest.fixture(scope="module")
def result(bench):
    return bench.main([*TINY, "--k", "2", "--json-only"])


def test_every_stage_reported_for_both_engines(result):
    assert set(result["engines"]) == {"zero-copy", "copy"}
    for mode, eng in result["engines"].items():
        expected = set(ALWAYS) | ({"sync_weights"} if mode == "copy" else set())
        assert set(eng["stages"]) == expected, mode
        for name, st in eng["stages"].items():
            assert math.isfinite(st["median_s"]) and st["median_s"] >= 0, (mode, name)
            assert st["min_s"] <= st["median_s"] <= st["max_s"], (mode, name)
        for key, v in eng["switch_s"].items():
            assert math.isfinite(v) and v > 0, (mode, key)
        labels = [row["boundary"] for row in eng["ledger_last_cycle"]]
        assert labels == ["rollout:ready", "rollout:generated", "score:ready", "train:ready", "train:end"]


def test_bytes_match_model_and_optimizer_sizes(result):
    param_bytes = result["model"]["params"] * 4  # fp32
    assert param_bytes == result["model"]["param_bytes"]
    for mode, eng in result["engines"].items():
        st = eng["stages"]
        for name in COPIED:
            assert st[name]["bytes"] > 0, (mode, name)
        # AdamW keeps two fp32 tensors (m, v) per parameter; what leaves must come back.
        assert st["offload_optimizer"]["bytes"] == st["onload_optimizer"]["bytes"] == 2 * param_bytes, mode
        # The reference moves its parameters plus its (tiny) buffers, e.g. rotary inv_freq.
        assert st["onload_ref"]["bytes"] == st["offload_ref"]["bytes"], mode
        assert param_bytes <= st["offload_ref"]["bytes"] <= param_bytes * 1.01, mode
        assert st["zero_grad"]["freed_bytes"] == param_bytes, mode  # the train step left fp32 grads behind
        assert st["kv_prefill"]["bytes"] > 0, mode
        # One process: nothing to gather (zero-copy); the copy engine only re-allocates (no bytes move).
        assert st["resume_weights"]["bytes"] == 0, mode
    assert result["engines"]["copy"]["stages"]["sync_weights"]["bytes"] == param_bytes
    assert result["engines"]["copy"]["engine_module_bytes"] == 0  # its weights are released outside rollout


def test_ratios_are_finite_where_bytes_are_copied(result):
    for mode, eng in result["engines"].items():
        for name, st in eng["stages"].items():
            if st["kind"] in ("copy", "gather") and st["bytes"] > 0:
                for key in ("gbps", "copy_gbps", "ratio"):
                    assert st[key] is not None and math.isfinite(st[key]) and st[key] > 0, (mode, name, key)
                assert st["copy_bytes"] == st["bytes"], (mode, name)  # same byte count as the stage
            else:
                assert st["ratio"] is None, (mode, name)


def test_flags_remove_their_stages(bench):
    res = bench.main(
        [
            *TINY,
            "--k",
            "1",
            "--warmup",
            "0",
            "--engine",
            "zero-copy",
            "--no-ref",
            "--no-offload-optimizer",
            "--no-train-step",
            "--json-only",
        ]
    )
    stages = res["engines"]["zero-copy"]["stages"]
    assert not {"offload_optimizer", "onload_optimizer", "onload_ref", "offload_ref", "sync_weights"} & set(stages)
    assert {"zero_grad", "resume_weights", "resume_kv", "release_engine"} <= set(stages)


def test_script_prints_table_then_json_last_line():
    proc = subprocess.run(
        [sys.executable, SCRIPT, *TINY, "--k", "1", "--engine", "copy"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("sync_weights") for line in lines[:-1]), proc.stdout[-3000:]
    res = json.loads(lines[-1])
    assert res["benchmark"] == "phase_swap" and res["device"] == "cpu"
    assert res["engines"]["copy"]["stages"]["sync_weights"]["bytes"] == res["model"]["param_bytes"]


def test_critic_stages_move_the_critics_bytes(bench):
    """--critic (PPO, issue 36): the critic's weights leave in ROLLOUT and come back for SCORE, its AdamW state leaves
    and comes back for TRAIN; each stage moves the critic's own bytes, counted here from the policy's (the critic is
    the same body without the LM head, plus an h + 1 value head; fp32). Catches: a critic stage missing, or moving
    another model's bytes."""
    res = bench.main([*TINY, "--k", "1", "--warmup", "0", "--engine", "zero-copy", "--critic", "--json-only"])
    st = res["engines"]["zero-copy"]["stages"]
    hidden = 64
    # The benchmark's Qwen2 ties its LM head to the embedding: dropping the head drops no parameter.
    critic_bytes = (res["model"]["params"] + hidden + 1) * 4
    assert st["offload_critic"]["bytes"] == st["onload_critic"]["bytes"]
    assert critic_bytes <= st["offload_critic"]["bytes"] <= critic_bytes * 1.01  # + rotary buffers
    assert st["offload_critic_optimizer"]["bytes"] == st["onload_critic_optimizer"]["bytes"] == 2 * critic_bytes
    rows = {r["boundary"]: r for r in res["engines"]["zero-copy"]["ledger_last_cycle"]}
    assert rows["rollout:ready"]["critic"] == 0 and rows["score:ready"]["critic"] == critic_bytes
    assert rows["train:ready"]["critic_optimizer"] == 2 * critic_bytes
