"""benchmarks/grpo_step.py end to end at a tiny size: the parent drives its worker processes over
the step protocol, and the last line is the JSON a reader (and the committed results) rely on.
No timing assertions: only that every number the README quotes is there and finite."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "benchmarks", "grpo_step.py")
TINY = [
    "--steps",
    "2",
    "--warmup",
    "1",
    "--max-new-tokens",
    "4",
    "--prompts",
    "4",
    "--n",
    "2",
    "--micro-batch",
    "8",
    "--threads",
    "1",
]


def _run(*extra: str) -> tuple[str, dict]:
    proc = subprocess.run(
        [sys.executable, SCRIPT, *TINY, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return proc.stdout, json.loads(lines[-1])


def _check_side(side: dict, steps: int) -> None:
    assert side["steps_measured"] == steps and len(side["warmup_step_s"]) == 1
    for key in ("median_step_s", "min_step_s", "startup_s", "total_wall_s", "reward_last", "reward_last5"):
        assert math.isfinite(side[key]), key
    assert 0 < side["min_step_s"] <= side["median_step_s"] <= side["max_step_s"]


def test_ours_and_padded_report_steps_phases_and_their_ratio() -> None:
    out, res = _run("--only", "ours", "--padded")
    (c,) = res["configs"]
    assert c["max_new_tokens"] == 4 and "trl" not in c
    assert "vllm" not in c and "trl_vllm" not in c, "the vLLM sides run only with --vllm (test_vllm_benchmarks.py)"
    for k in ("ours", "padded"):
        _check_side(c[k], 2)
        phases = c[k]["phases_median_s"]
        assert {"rollout", "score", "train", "step"} <= set(phases), phases
        assert phases["rollout"] + phases["train"] <= phases["step"] * 1.01
    assert c["ratio_padded_over_ours"] == pytest.approx(c["padded"]["median_step_s"] / c["ours"]["median_step_s"])
    assert res["settings"]["prompts"] == 4 and res["settings"]["n"] == 2
    assert "ours phases (median s), 4 new tokens:" in out


def test_trl_side_runs_interleaved_and_gives_the_ratio() -> None:
    pytest.importorskip("trl")
    _, res = _run()
    (c,) = res["configs"]
    _check_side(c["ours"], 2)
    _check_side(c["trl"], 2)
    assert c["ratio_trl_over_ours"] == pytest.approx(c["trl"]["median_step_s"] / c["ours"]["median_step_s"])
