"""The run's pictures, drawn from its step records (metrics.jsonl, a resumed run's earlier steps included).

    dashboard.png     one page per run: reward and accuracy with the validation points; response length and
                      truncation; KL to the reference and entropy; the step's seconds split by phase; device
                      memory per phase (the peak of each phase's boundaries, every step); grad norm and lr
    reward_curve.png  the dashboard's reward panel alone, larger

Steps are integers on every axis, legends sit below their panel (never over the data), a running mean is
drawn only where it averages more than one step, and a panel whose metrics the run has none of says so
instead of drawing an empty frame. Memory per phase comes from `phase_memory`, which the Trainer adds to
each step's metrics from the phase switch's ledger.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional, Sequence

from hybrid_rl.observability.metrics import PHASE_TIMES

PHASES = ("rollout", "reward", "score", "train")  # the phase switch's phases, in the order a step runs them


def phase_memory(snapshots: Iterable[tuple[str, int]]) -> dict[str, float]:
    """{"memory/phase_<phase>_peak": bytes}: the largest total of the role bytes at the boundaries of each phase
    in one step, from the ledger's (label "<phase>:<moment>", total bytes) snapshots."""
    out: dict[str, float] = {}
    for label, total in snapshots:
        key = f"memory/phase_{label.split(':')[0]}_peak"
        out[key] = max(out.get(key, 0.0), float(total))
    return out


def _series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in records if key in r and r[key] is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def _running_mean(values: list[float], w: int) -> list[float]:
    return [sum(values[max(0, i - w + 1) : i + 1]) / len(values[max(0, i - w + 1) : i + 1]) for i in range(len(values))]


def _finish(ax, title: str, ylabel: str, handles: Optional[list] = None) -> None:
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in [ax, *[other for other in ax.figure.axes if other is not ax and other.bbox.bounds == ax.bbox.bounds]]:
        if isinstance(axis.yaxis.get_major_formatter(), ScalarFormatter):
            axis.yaxis.get_major_formatter().set_useOffset(False)  # "1e-5+5.546" reads worse than the values
    ax.grid(alpha=0.3)
    lines, labels = ([], []) if handles is None else (handles, [h.get_label() for h in handles])
    if handles is None:
        lines, labels = ax.get_legend_handles_labels()
    if lines:  # below the panel, outside the data
        ax.legend(lines, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(3, len(lines)), fontsize=8)


def _nothing(ax, title: str, why: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.text(0.5, 0.5, why, ha="center", va="center", fontsize=9, color="0.4", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def reward_panel(ax, records: Sequence[dict], val: Sequence[dict]) -> None:
    """Mean reward per step (with a running mean when it averages several steps), accuracy, validation points."""
    steps, reward = _series(records, "reward/mean")
    ax.plot(steps, reward, lw=1, alpha=0.6, color="C0", label="reward (train)")
    w = max(1, len(reward) // 20)
    if w > 1:
        ax.plot(steps, _running_mean(reward, w), lw=2, color="C0", label=f"reward, mean of {w} steps")
    s, acc = _series(records, "reward/accuracy")
    if acc:
        ax.plot(s, acc, lw=1, ls="--", color="C2", label="accuracy (train)")  # dashed: visible on the reward
    for key, style, label in (("val/pass@1", "o", "val pass@1"), ("val/reward_mean", "s", "val reward")):
        s, v = _series(val, key)
        if v:
            ax.plot(s, v, style, ms=6, mfc="none", mew=1.5, color="C3" if key == "val/pass@1" else "C1", label=label)
    _finish(ax, "reward and accuracy", "reward / share")


def length_panel(ax, records: Sequence[dict]) -> None:
    steps, length = _series(records, "response/length")
    if not length:
        return _nothing(ax, "response length", "no response metrics")
    ax.plot(steps, length, color="C0", label="mean response tokens")
    s_lo, lo = _series(records, "response/length_min")
    s_hi, hi = _series(records, "response/length_max")
    if lo and hi and s_lo == s_hi == steps:
        ax.fill_between(steps, lo, hi, color="C0", alpha=0.15, label="min to max")
    twin = ax.twinx()
    s, trunc = _series(records, "response/truncated")
    twin.plot(s, trunc, color="C3", lw=1, ls="--", label="truncated (share)")
    twin.set_ylim(-0.05, 1.05)
    twin.set_ylabel("truncated share")
    _finish(ax, "response length and truncation", "tokens", ax.get_lines() + ax.collections + twin.get_lines())


def kl_entropy_panel(ax, records: Sequence[dict]) -> None:
    s_kl, kl = _series(records, "actor/kl_ref")
    s_h, ent = _series(records, "actor/entropy")
    if not kl and not ent:
        return _nothing(ax, "KL and entropy", "no KL or entropy metrics")
    handles = []
    if kl:
        handles += ax.plot(s_kl, kl, color="C4", label="KL to reference")
    twin = ax.twinx()
    if ent:
        handles += twin.plot(s_h, ent, color="C5", label="entropy")
        twin.set_ylabel("entropy (nats)")
    _finish(ax, "KL to the reference and entropy", "KL" if kl else "", handles)
    if not kl:
        ax.set_yticks([])


def time_panel(ax, records: Sequence[dict]) -> None:
    steps = [int(r["step"]) for r in records]
    if not steps:
        return _nothing(ax, "step time", "no steps")
    split = {name: [sum(float(r.get(k, 0.0)) for k in keys) for r in records] for name, keys in PHASE_TIMES.items()}
    colors = [f"C{i}" for i in range(len(split))]
    if len(steps) > 40:  # bars thinner than a pixel alias into stripes: stack areas instead
        ax.stackplot(steps, *split.values(), labels=list(split), colors=colors)
    else:
        bottom = [0.0] * len(steps)
        for (name, sec), color in zip(split.items(), colors):
            ax.bar(steps, sec, bottom=bottom, width=0.9, color=color, label=name)
            bottom = [b + x for b, x in zip(bottom, sec)]
    _finish(ax, "seconds per step, by phase", "seconds")


def memory_panel(ax, records: Sequence[dict]) -> None:
    handles = []
    for i, phase in enumerate(PHASES):
        s, v = _series(records, f"memory/phase_{phase}_peak")
        if v and max(v) > 0:
            mark = "." if len(s) <= 40 else None
            handles += ax.plot(s, [x / 1e6 for x in v], color=f"C{i}", marker=mark, ms=3, label=f"{phase} peak")
    s, v = _series(records, "memory/cuda_reserved_peak")
    if v:
        handles += ax.plot(s, [x / 1e6 for x in v], color="k", ls=":", label="CUDA reserved peak")
    if not handles:
        return _nothing(ax, "device memory per phase", "no memory metrics")
    _finish(ax, "device memory per phase (roles at its boundaries)", "MB", handles)


def update_panel(ax, records: Sequence[dict]) -> None:
    s, g = _series(records, "actor/grad_norm")
    if not g:
        return _nothing(ax, "update", "no update metrics")
    handles = ax.plot(s, g, color="C0", label="grad norm")
    s_lr, lr = _series(records, "actor/lr")
    if lr:
        twin = ax.twinx()
        handles += twin.plot(s_lr, lr, color="C1", ls="--", label="learning rate")
        twin.set_ylabel("lr")
        twin.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _finish(ax, "update: grad norm and learning rate", "grad norm", handles)


def _validation(records: Sequence[dict], extra: Sequence[dict]) -> list[dict]:
    """The records that hold validation metrics: the steps' own and those logged on their own (step 0)."""
    by_step = {int(r["step"]): r for r in [*extra, *records] if any(k.startswith("val/") for k in r)}
    return [by_step[k] for k in sorted(by_step)]


def plot_dashboard(records: Sequence[dict], path: str, validation: Sequence[dict] = (), title: str = "") -> None:
    """The one-page dashboard of a run (module docstring). records: the step records in step order;
    validation: records of validations logged without a step (val_before_train's step 0)."""
    plt = _pyplot()
    val = _validation(records, validation)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    reward_panel(axes[0, 0], records, val)
    length_panel(axes[0, 1], records)
    kl_entropy_panel(axes[0, 2], records)
    time_panel(axes[1, 0], records)
    memory_panel(axes[1, 1], records)
    update_panel(axes[1, 2], records)
    steps = [int(r["step"]) for r in records]
    span = f"steps {min(steps)}-{max(steps)}" if steps else "no steps"
    fig.suptitle(f"{title or 'run'}: {span}", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97), h_pad=3.0)
    _save(fig, path)


def plot_reward(records: Sequence[dict], path: str, validation: Sequence[dict] = ()) -> None:
    """The reward panel alone (reward_curve.png)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    reward_panel(ax, records, _validation(records, validation))
    fig.tight_layout()
    _save(fig, path)


def draw_run(records: Sequence[dict], out_dir: str) -> list[str]:
    """dashboard.png and reward_curve.png of the run in `out_dir` from its step records (run_history's); the
    validations logged on their own come from its metrics.jsonl. Returns the paths written."""
    extra = []
    try:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut short by a crash
                if isinstance(r, dict) and "step" in r and "reward/mean" not in r:
                    extra.append(r)
    except OSError:
        pass
    paths = [os.path.join(out_dir, "dashboard.png"), os.path.join(out_dir, "reward_curve.png")]
    plot_dashboard(records, paths[0], extra, title=os.path.basename(os.path.normpath(out_dir)))
    plot_reward(records, paths[1], extra)
    return paths


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
