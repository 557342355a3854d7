"""benchmarks/partial_rollouts.py: the long-tail rows and the reward-at-a-wall-time rule on hand-made inputs, and the
script end to end at a tiny size (the native engine, one seed, one setting). No timing assertions: only that the
numbers the results file quotes are there and finite, and that the two sides differ in rollout.partial alone."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "benchmarks", "partial_rollouts.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("partial_rollouts_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_longtail_rows_have_the_asked_lengths_and_answers(bench) -> None:
    rows = bench.longtail_rows(400, 0.15, 12, 16, 3, seed=0)
    lens = [len(r["answer"]) for r in rows]
    assert set(lens) <= {3} | set(range(12, 17))
    assert 0.08 < sum(n > 3 for n in lens) / len(rows) < 0.22
    for r in rows:
        digits = r["prompt"].split()
        assert digits[-1] == "=" and len(digits) - 1 == len(r["answer"])
        assert r["answer"] == "".join(str((int(d) + 1) % 10) for d in digits[:-1])
    assert bench.longtail_rows(50, 0.15, 12, 16, 3, seed=1) == bench.longtail_rows(50, 0.15, 12, 16, 3, seed=1)


def _step(step_s: float, reward: float, n_short: int = 0, r_short=None, n_long: int = 0, r_long=None) -> dict:
    rows = {"n_short": n_short, "reward_short": r_short, "tokens_short": 4.0 if n_short else None}
    rows.update({"n_long": n_long, "reward_long": r_long, "tokens_long": 15.0 if n_long else None})
    return {"step_s": step_s, "reward/mean": reward, "rows": rows, "phases": {}}


def test_reward_at_cutoff_takes_the_last_steps_that_ended_by_then(bench) -> None:
    # Steps end at 1, 3, 6, 10 s: by T = 6 the first three ended; a window of 2 is steps 2 and 3.
    w = SimpleNamespace(
        steps=[_step(1, 0.1, 6, 0.1, 2, 0.1), _step(2, 0.2, 8, 0.25), _step(3, 0.3, 6, 0.4, 2, 0.0), _step(4, 0.9)]
    )
    got = bench.reward_at(w, cutoff=6.0, k=2, long_share=0.25)
    assert got["steps"] == 3
    assert got["reward"] == pytest.approx(0.25)
    short = (8 * 0.25 + 6 * 0.4) / 14  # pooled over the rows of steps 2 and 3
    assert got["reward_short"] == pytest.approx(short) and got["reward_long"] == pytest.approx(0.0)
    assert got["reward_reweighted"] == pytest.approx(0.75 * short + 0.25 * 0.0)
    # No long row in the window: no reweighted reward (never the short rows' alone), unless there are no long rows.
    assert bench.reward_at(w, cutoff=3.0, k=1, long_share=0.25)["reward_reweighted"] is None
    assert bench.reward_at(w, cutoff=3.0, k=1, long_share=0.0)["reward_reweighted"] == pytest.approx(0.25)


def test_sides_differ_in_rollout_partial_only(bench) -> None:
    a = bench.parse(["--seeds", "0"])
    a.model, a.data = "/m", "/d.jsonl"
    off = bench.side_overrides(a, "off", "native", "longtail", 0, "/o")
    on = bench.side_overrides(a, "on", "native", "longtail", 0, "/o")
    assert on[: len(off)] == off
    partial = ["rollout.partial=true", "rollout.partial_over=1.5", "rollout.partial_stop=1.0"]
    assert on[len(off) :] == [*partial, "rollout.partial_kv=recompute"]
    assert "data.task=jsonl" in off and "data.task=digits" in bench.side_overrides(a, "off", "vllm", "uniform", 1, "/o")
    keep = bench.parse(["--seeds", "0", "--partial-kv", "keep"])
    keep.model, keep.data = "/m", "/d.jsonl"
    assert bench.side_overrides(keep, "on", "native", "longtail", 0, "/o")[-1] == "rollout.partial_kv=keep"
    assert bench.side_overrides(keep, "on", "vllm", "longtail", 0, "/o")[-1] == "rollout.partial_kv=recompute"
    assert "rollout.partial_kv=keep" not in bench.side_overrides(keep, "off", "native", "longtail", 0, "/o")
    assert "trainer.device=cpu" in off and "trainer.device=cpu" in on  # the default
    gpu = bench.parse(["--seeds", "0", "--device", "cuda"])
    gpu.model, gpu.data = "/m", "/d.jsonl"
    assert all(
        "trainer.device=cuda" in bench.side_overrides(gpu, side, "native", "longtail", 0, "/o")
        for side in "off on".split()
    )


def test_help_says_how_the_tail_is_made() -> None:
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "long-tail" in proc.stdout and "--partial-over" in proc.stdout


@pytest.mark.slow  # two trainer processes (about 25 s on the 2-core VM)
def test_tiny_run_reports_both_sides_and_the_ratios() -> None:
    tiny = ["--seeds", "0", "--settings", "longtail", "--steps", "2", "--warmup", "1", "--prompts", "4", "--n", "2"]
    tiny += ["--sft-steps", "2", "--sft-batch", "4", "--rows", "40", "--long-frac", "0.5", "--micro-batch", "8"]
    tiny += ["--mini-batch", "8", "--max-new-tokens", "20"]
    proc = subprocess.run([sys.executable, SCRIPT, *tiny], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    (pair,) = res["pairs"]
    assert "error" not in pair, pair.get("error")
    for side in ("off", "on"):
        s = pair[side]
        assert s["steps_measured"] == 2 and len(s["curve"]) == 3
        for key in ("median_step_s", "median_rollout_s", "tokens_per_step", "total_step_s"):
            assert math.isfinite(s[key]) and s[key] >= 0, key
    assert "dropped_stale_total" in pair["on"] and "dropped_stale_total" not in pair["off"]
    assert pair["cutoff_s"] == pytest.approx(min(pair["off"]["total_step_s"], pair["on"]["total_step_s"]))
    assert pair["speedup_step"] == pytest.approx(pair["off"]["median_step_s"] / pair["on"]["median_step_s"])
    agg = res["aggregate"]["native/longtail"]
    assert agg["seeds"] == [0] and agg["speedup_step_mean"] == pytest.approx(pair["speedup_step"])
    assert res["dataset"]["rows"] == 40 and res["warm_start"]["steps"] == 2


def test_the_fixedstep_setting_brings_its_own_batch_and_tail(bench) -> None:
    """The fixedstep preset replaces the flags it names, for both sides alike; the other settings keep the flags."""
    a = bench.parse(["--seeds", "0"])
    sa = bench.setting_args(a, "fixedstep")
    sa.model, sa.data = "/m", "/d.jsonl"
    off = bench.side_overrides(sa, "off", "native", "fixedstep", 0, "/o")
    on = bench.side_overrides(sa, "on", "native", "fixedstep", 0, "/o")
    assert on[: len(off)] == off and on[len(off) :][0] == "rollout.partial=true"
    for kv in ("data.task=jsonl", "data.batch_size=8", "rollout.n=2", "rollout.max_new_tokens=40"):
        assert kv in off, kv
    assert "trainer.max_staleness=8" in off and "algorithm.mini_batch_size=16" in off and "optim.lr=0.0005" in off
    assert (sa.long_min, sa.long_max) == (24, 32) and bench.is_longtail("fixedstep")
    assert bench.setting_args(a, "longtail").prompts == a.prompts == 32 and not bench.is_longtail("uniform")
