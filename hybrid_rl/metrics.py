"""Per-step metrics: reduction over ranks, the metrics.jsonl log, the reward curve."""
from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from hybrid_rl import distributed as D


class MeanAccumulator:
    """Sums and counts of named scalars, reduced over ranks with one all-reduce."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)

    def reduce(self) -> dict[str, float]:
        names = sorted(self.sums)  # same order on every rank
        buf = torch.tensor([[self.sums[n], self.counts[n]] for n in names], dtype=torch.float64).reshape(-1, 2)
        D.all_reduce_sum(buf)
        return {n: (buf[i, 0] / buf[i, 1]).item() if buf[i, 1] > 0 else 0.0 for i, n in enumerate(names)}


def append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def format_line(m: dict) -> str:
    keys = [("step", "{:d}"), ("reward/mean", "{:.3f}"), ("reward/accuracy", "{:.2f}"), ("response/length", "{:.1f}"),
            ("actor/kl_ref", "{:.4f}"), ("actor/entropy", "{:.3f}"), ("actor/clip_frac", "{:.3f}"),
            ("actor/grad_norm", "{:.3f}"), ("time/step", "{:.2f}s"), ("bottleneck", "{}")]
    return "  ".join(f"{k.replace('/mean', '').split('/')[-1]}={fmt.format(m[k])}" for k, fmt in keys if k in m)


def plot_curve(history: Sequence[dict], path: str, key: str = "reward/mean") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    values = [h[key] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, values, lw=1, alpha=0.5, label=key)
    w = max(1, len(values) // 20)
    if len(values) >= w:
        smooth = [sum(values[max(0, i - w + 1):i + 1]) / len(values[max(0, i - w + 1):i + 1]) for i in range(len(values))]
        ax.plot(steps, smooth, lw=2, label=f"{key} (running mean, {w})")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# Wall-clock buckets of one step, in the order they happen.
PHASE_TIMES = {"rollout": ("time/rollout", "time/reward"), "scoring": ("time/score",), "training": ("time/train",),
               "switching": ("time/switch",)}


def time_split(m: dict) -> dict[str, float]:
    return {name: sum(m.get(k, 0.0) for k in keys) for name, keys in PHASE_TIMES.items()}


def bottleneck(m: dict) -> str:
    """The phase that took most of the step: 'rollout-bound', 'training-bound', ..."""
    split = time_split(m)
    return max(split, key=split.get) + "-bound"


def split_summary(history: Sequence[dict]) -> str:
    """One line: share of wall clock per phase over a run, and the dominant phase."""
    totals = {name: sum(time_split(h)[name] for h in history) for name in PHASE_TIMES}
    whole = sum(totals.values()) or 1.0
    parts = " | ".join(f"{name} {100 * t / whole:.0f}%" for name, t in totals.items())
    return f"time split over {len(history)} steps: {parts} -> {max(totals, key=totals.get)}-bound"
