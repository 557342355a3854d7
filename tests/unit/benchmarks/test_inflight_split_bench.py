"""benchmarks/inflight_split.py: its per-run summary on a hand-made history, and the script end to end at a tiny size
(one seed, k = 1, both modes). No timing assertions: the fields the results file quotes are there and finite, drain
takes nothing mid-batch, and the staleness measures keep their order (a token is never older than its group)."""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def bench():
    """Imported by name (benchmarks/ on sys.path): its rank function is pickled for the spawned ranks."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    return importlib.import_module("inflight_split")


def test_summary_of_a_hand_made_history(bench):
    def step(i):
        return {
            "split/token_staleness_mean": 0.5 + 0.1 * i,
            "split/staleness_mean": 1.0,
            "split/inflight_updates": float(i % 2),
            "time/step": 0.1 * (i + 1),
            "time/rollout": 0.05,
            "reward/mean": 0.1 * i,
        }

    s = bench.summary([step(i) for i in range(8)], warmup=2)  # steps 2..7 measured; last 5 rewards: steps 3..7
    assert s["token_staleness"] == pytest.approx(0.5 + 0.1 * 4.5)
    assert s["group_staleness"] == 1.0 and s["inflight_per_step"] == pytest.approx(0.5)
    assert s["step_s"] == pytest.approx(0.1 * 5.5) and s["reward_last5"] == pytest.approx(0.5)


@pytest.mark.slow
def test_the_script_end_to_end(bench):
    out = bench.main(
        ["--steps", "3", "--seeds", "0", "--ks", "1", "--batch", "4", "--tokens", "12", "--decode-ms", "8"]
    )
    runs = {r["mode"]: r for r in out["runs"]}
    assert set(runs) == {"drain", "continue"}
    for r in runs.values():
        assert all(math.isfinite(r[k]) for k in ("token_staleness", "group_staleness", "step_s", "reward_last5"))
        assert r["token_staleness"] <= r["group_staleness"] + 1e-9
    assert runs["drain"]["inflight_per_step"] == 0.0
    assert set(out["aggregate"]) == {"k1_drain", "k1_continue"}
