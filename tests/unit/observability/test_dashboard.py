"""The run's pictures (observability/dashboard.py): one dashboard per run and the reward curve, drawn from step
records as metrics.jsonl holds them.

Catches: validation points or accuracy missing from the reward picture, a "running mean" that repeats the raw
curve (a window of one step), fractional step ticks, a legend drawn over the data, memory shown for one step
instead of the run, a panel that draws nothing without saying why, and the step-0 validation (logged on its
own line) left out.
"""

from __future__ import annotations

import json
import math
import os

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hybrid_rl.observability import dashboard as dash  # noqa: E402


def _records(n: int, every_val: int = 0) -> list[dict]:
    out = []
    for s in range(1, n + 1):
        r = {
            "step": s,
            "reward/mean": 0.1 + 0.8 * s / n + 0.05 * math.sin(s),
            "reward/accuracy": 0.7 * s / n,
            "response/length": 4.0 - 2 * s / n,
            "response/length_min": 1.0,
            "response/length_max": 4.0,
            "response/truncated": 1 - s / n,
            "actor/kl_ref": 0.01 * s,
            "actor/entropy": 2.0 - s / n,
            "actor/grad_norm": 1.0,
            "actor/lr": 1e-3,
            "time/rollout": 0.1,
            "time/reward": 0.01,
            "time/score": 0.05,
            "time/train": 0.2,
            "time/switch": 0.02,
            "memory/phase_rollout_peak": 5e6,
            "memory/phase_score_peak": 6e6,
            "memory/phase_train_peak": 8e6 + 1e4 * s,
        }
        if every_val and s % every_val == 0:
            r.update({"val/pass@1": s / n, "val/reward_mean": 0.2 + s / n / 2})
        out.append(r)
    return out


def _legend_outside(ax) -> bool:
    fig = ax.figure
    fig.canvas.draw()
    legend = ax.get_legend()
    return legend is not None and legend.get_window_extent().y1 < ax.get_window_extent().y0


def test_the_reward_panel_has_accuracy_validation_and_a_true_running_mean():
    fig, ax = plt.subplots()
    dash.reward_panel(ax, _records(60, every_val=20), dash._validation(_records(60, every_val=20), []))
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["reward (train)", "reward, mean of 3 steps", "accuracy (train)", "val pass@1", "val reward"]
    val = next(line for line in ax.get_lines() if line.get_label() == "val pass@1")
    assert list(val.get_xdata()) == [20, 40, 60] and val.get_linestyle() == "None"
    assert _legend_outside(ax)
    ticks = ax.get_xticks()
    assert all(float(t).is_integer() for t in ticks)
    plt.close(fig)

    fig, ax = plt.subplots()
    dash.reward_panel(ax, _records(5), [])  # a window of one step would repeat the curve: not drawn
    assert [line.get_label() for line in ax.get_lines()] == ["reward (train)", "accuracy (train)"]
    assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_xticks()
    plt.close(fig)


def test_step_zero_validation_logged_on_its_own_is_drawn(tmp_path):
    records = _records(4, every_val=2)
    step0 = {"step": 0, "val/pass@1": 0.05, "val/reward_mean": 0.1}
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in [step0, *records]:
            f.write(json.dumps(r) + "\n")
    assert [r["step"] for r in dash._validation(records, [step0])] == [0, 2, 4]
    paths = dash.draw_run(records, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["dashboard.png", "reward_curve.png"]
    assert all(os.path.getsize(p) > 10_000 for p in paths)


@pytest.mark.parametrize(
    "panel", [dash.length_panel, dash.kl_entropy_panel, dash.time_panel, dash.memory_panel, dash.update_panel]
)
def test_every_panel_keeps_its_legend_below_the_data_and_integer_steps(panel):
    fig, ax = plt.subplots()
    panel(ax, _records(7))
    assert _legend_outside(ax), panel.__name__
    assert all(float(t).is_integer() for t in ax.get_xticks()), (panel.__name__, ax.get_xticks())
    plt.close(fig)


def test_memory_is_drawn_for_every_step_of_the_run():
    fig, ax = plt.subplots()
    dash.memory_panel(ax, _records(30))
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"rollout peak", "score peak", "train peak"}
    assert list(lines["train peak"].get_xdata()) == list(range(1, 31))
    assert lines["train peak"].get_ydata()[-1] == pytest.approx(8.3)  # MB
    plt.close(fig)


def test_a_panel_without_its_metrics_says_so():
    fig, ax = plt.subplots()
    dash.kl_entropy_panel(ax, [{"step": 1, "reward/mean": 0.0}])
    assert [t.get_text() for t in ax.texts] == ["no KL or entropy metrics"] and not ax.get_lines()
    plt.close(fig)


def test_phase_memory_takes_each_phases_largest_boundary():
    snaps = [("rollout:ready", 5), ("rollout:generated", 9), ("score:ready", 4), ("train:ready", 7), ("train:end", 6)]
    assert dash.phase_memory(snaps) == {
        "memory/phase_rollout_peak": 9.0,
        "memory/phase_score_peak": 4.0,
        "memory/phase_train_peak": 7.0,
    }
