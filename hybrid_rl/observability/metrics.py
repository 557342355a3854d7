"""Per-step metrics: stage timing, reduction over ranks, the metrics.jsonl log, the reward curve."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Iterator, Sequence, Union

import torch

from hybrid_rl.runtime import distributed as D

Number = Union[float, int, torch.Tensor]


class MeanAccumulator:
    """Named (sum, count) pairs and named maxima, reduced over ranks together.

    Values may be Python numbers or 0-d tensors on the compute device: they are
    stacked and copied to the host ONCE in `reduce()` (one device sync for all the
    metrics of a stage, not one per metric). Helpers build and return their own
    accumulator; the caller merges it with `|=`.
    """

    def __init__(self) -> None:
        self.sums: dict[str, list[Number]] = {}
        self.counts: dict[str, list[Number]] = {}
        self.maxima: dict[str, list[Number]] = {}
        self.minima: set[str] = set()  # names in `maxima` that hold negated values (add_min)

    def add(self, name: str, total: Number, count: Number = 1.0) -> None:
        """Add `total` over `count` items to the mean `name` (mean = sum of totals / sum of counts)."""
        self.sums.setdefault(name, []).append(total)
        self.counts.setdefault(name, []).append(count)

    def add_max(self, name: str, value: Number) -> None:
        """`name` reports the maximum over every value added, on every rank (-inf adds nothing)."""
        self.maxima.setdefault(name, []).append(value)

    def add_min(self, name: str, value: Number) -> None:
        """`name` reports the minimum over every value added, on every rank (+inf adds nothing)."""
        self.minima.add(name)
        self.maxima.setdefault(name, []).append(-value)  # min(x) = -max(-x): one reduction serves both

    def __ior__(self, other: "MeanAccumulator") -> "MeanAccumulator":
        for name in other.sums:
            self.sums.setdefault(name, []).extend(other.sums[name])
            self.counts.setdefault(name, []).extend(other.counts[name])
        for name, values in other.maxima.items():
            self.maxima.setdefault(name, []).extend(values)
        self.minima |= other.minima
        return self

    def reduce(self) -> dict[str, float]:
        """Means and maxima over every rank; every rank must call it with the same names."""
        means, maxes = sorted(self.sums), sorted(self.maxima)  # same order on every rank
        series = [self.sums[n] for n in means] + [self.counts[n] for n in means] + [self.maxima[n] for n in maxes]
        host = _to_host([v for values in series for v in values])
        folded, i = [], 0
        for k, values in enumerate(series):
            part, i = host[i : i + len(values)], i + len(values)
            folded.append(max(part) if k >= 2 * len(means) else sum(part))
        out = {}
        if means:
            sc = D.all_reduce_sum(torch.tensor(folded[: 2 * len(means)], dtype=torch.float64).view(2, -1))
            out.update({n: (sc[0, j] / sc[1, j]).item() if sc[1, j] > 0 else 0.0 for j, n in enumerate(means)})
        if maxes:
            top = D.all_reduce_max(torch.tensor(folded[2 * len(means) :], dtype=torch.float64))
            out.update({n: -top[j].item() if n in self.minima else top[j].item() for j, n in enumerate(maxes)})
        return out


def _to_host(values: list[Number]) -> list[float]:
    """All values as floats, with every device tensor copied in one transfer."""
    tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    out = [float(v) if not isinstance(v, torch.Tensor) else 0.0 for v in values]
    if tensors:
        host = torch.stack([v.detach().reshape(()).to(torch.float64) for _, v in tensors]).cpu().tolist()
        for (i, _), h in zip(tensors, host):
            out[i] = h
    return out


class StageTimer:
    """Seconds per stage of one step: `with timer("rollout"): ...` adds to `time/rollout`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{stage}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0


def append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def format_line(m: dict) -> str:
    """One console line of a step's main metrics (time/step shows as `time=`)."""
    keys = [
        ("step", "{:d}"),
        ("reward/mean", "{:.3f}"),
        ("reward/accuracy", "{:.2f}"),
        ("response/truncated", "{:.2f}"),
        ("response/length", "{:.1f}"),
        ("actor/kl_ref", "{:.4f}"),
        ("actor/entropy", "{:.3f}"),
        ("actor/clip_frac", "{:.3f}"),
        ("actor/grad_norm", "{:.3f}"),
        ("time/step", "{:.2f}s"),
        ("bottleneck", "{}"),
    ]
    label = {"time/step": "time"}
    line = "  ".join(
        f"{label.get(k, k.replace('/mean', '').split('/')[-1])}={fmt.format(m[k])}" for k, fmt in keys if k in m
    )
    return line + episode_troubles(m)


def episode_troubles(m: dict) -> str:
    """What went wrong in the step's episodes, when anything did: environment steps past env.timeout_s, tool calls
    that raised, calls that did not parse; each as a count and a share ('' in a step without any). Metrics hold
    them as means per episode (episode/*); the step's episode count turns them back into counts."""
    n = m.get("episode/count")
    if not n:
        return ""
    timeouts = round(m.get("episode/end_timeout", 0.0) * n)
    calls = round(m.get("episode/tool_calls", 0.0) * n)
    errors = round(m.get("episode/tool_errors", 0.0) * n)
    malformed = round(m.get("episode/malformed_calls", 0.0) * n)
    parts = []
    if timeouts:
        parts.append(f"timeouts={timeouts} ({100 * timeouts / n:.0f}% of {n:.0f} episodes)")
    if errors:
        parts.append(f"tool_errors={errors} ({100 * errors / max(calls, 1):.0f}% of {calls} calls)")
    if malformed:
        parts.append(f"malformed_calls={malformed} ({100 * malformed / (calls + malformed):.0f}% of call attempts)")
    return "".join(f"  {p}" for p in parts)


def console_legend(success_threshold: float | None, episodes: bool = False) -> str:
    """What the console columns mean (printed once, before the first step line; docs/metrics.md has them all).
    accuracy counts a sample only at the reward's "correct" threshold, so it can sit at 0 while partial credit
    (reward) climbs: the digits demo pays 1.0 only for three right digits AND stopping after them."""
    thr = "reward.success_threshold" + (
        f" = {success_threshold:g}"
        if success_threshold is not None
        else ", the reward's own: 1.0 unless it registered another"
    )
    return (
        "columns: reward = mean reward of the step's samples; accuracy = share of samples whose (rule) reward "
        f"reaches {thr} (full marks only: partial credit moves reward, not accuracy); truncated = share cut off "
        "at rollout.max_new_tokens (they never stopped); length = mean response tokens; kl_ref, entropy, "
        "clip_frac, grad_norm: the update's; time = seconds per step; bottleneck = the phase that took most "
        "of it" + EPISODE_LEGEND * episodes + " (docs/metrics.md)"
    )


# What the console's columns mean in a multi-turn run (env.*), added to the legend.
EPISODE_LEGEND = (
    "; episodes: length counts the model's own tokens (not observations), truncated the episodes cut by "
    "rollout.max_turns, rollout.max_episode_tokens or a timeout, and timeouts, tool_errors and malformed_calls "
    "show (count, share) in a step that has any"
)


def format_val_line(m: dict) -> str:
    """One line of a validation's `val/*` metrics (pass@1 first, then the rest in name order)."""
    head = [f"val step={m['step']:d}"] if "step" in m else ["val"]
    names = sorted((k for k in m if k.startswith("val/")), key=lambda k: (k != "val/pass@1", k))

    def value(k: str, v) -> str:
        if k == "val/prompts":  # a count, logged as a float like every metric
            return f"{v:.0f}"
        return f"{v:.3f}" if isinstance(v, float) else f"{v}"

    return "  ".join(head + [f"{k[4:]}={value(k, m[k])}" for k in names])


# Wall-clock buckets of one step, in the order they happen.
PHASE_TIMES = {
    "rollout": ("time/rollout", "time/reward"),
    "scoring": ("time/score", "time/advantage"),
    "training": ("time/train",),
    "switching": ("time/switch",),
}


def time_split(m: dict) -> dict[str, float]:
    return {name: sum(m.get(k, 0.0) for k in keys) for name, keys in PHASE_TIMES.items()}


def bottleneck(m: dict) -> str:
    """The phase that took most of the step: 'rollout-bound', 'training-bound', ..."""
    split = time_split(m)
    return max(split, key=split.get) + "-bound"


def run_history(out_dir: str, history: Sequence[dict]) -> list[dict]:
    """The whole run's step records: `out_dir`/metrics.jsonl (a resume keeps the lines up to its step and
    appends, loggers.restart_jsonl), the last record of each training step in step order; `history` (this
    process's steps) when the file is missing or unreadable. So a resumed run's curve and summaries start at
    step 1, not at the resume."""
    path = os.path.join(out_dir, "metrics.jsonl")
    by_step: dict[int, dict] = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut short by a crash
                if isinstance(record, dict) and "reward/mean" in record and "step" in record:
                    by_step[int(record["step"])] = record
    except OSError:
        return list(history)
    return [by_step[k] for k in sorted(by_step)] or list(history)


def reward_summary(records: Sequence[dict], this_time: int) -> tuple[dict, str]:
    """({steps, reward_first10, reward_last10}, the printed line) over `records` (run_history's), saying how
    many steps this process ran (`this_time`); a run with no steps says so instead of averaging nothing."""
    if not records:
        return {"steps": 0, "reward_first10": None, "reward_last10": None}, "reward: no training steps recorded yet"
    k = max(1, len(records) // 10)
    first = sum(h["reward/mean"] for h in records[:k]) / k
    last = sum(h["reward/mean"] for h in records[-k:]) / k
    where = "" if this_time == len(records) else f" ({this_time} of them in this process; the rest from metrics.jsonl)"
    return (
        {"steps": len(records), "reward_first10": first, "reward_last10": last},
        f"reward: first 10% {first:.3f} -> last 10% {last:.3f} over {len(records)} steps{where}",
    )


def split_summary(history: Sequence[dict]) -> str:
    """One line: share of wall clock per phase over a run, and the dominant phase."""
    totals = {name: sum(time_split(h)[name] for h in history) for name in PHASE_TIMES}
    whole = sum(totals.values()) or 1.0
    parts = " | ".join(f"{name} {100 * t / whole:.0f}%" for name, t in totals.items())
    return f"time split over {len(history)} steps: {parts} -> {max(totals, key=totals.get)}-bound"


def step_time_metrics(timer: StageTimer, switch) -> dict[str, float]:
    """Seconds per stage and per switch stage (`switch`: the phase switch's SwitchStats of the step), the slowest
    rank's: that is what the step waits for; and the bytes the weight sync sent this rank (the same on every rank:
    0 for the native engine, which decodes with the policy itself; the adapters only with LoRA)."""
    seconds = {k: 0.0 for k in ("time/rollout", "time/reward", "time/score", "time/advantage", "time/train")}
    seconds.update(timer.seconds)
    seconds.update({f"switch/{stage}_s": sec for stage, sec in switch.seconds.items()})
    seconds["time/switch"] = sum(switch.seconds.values())
    names = sorted(seconds)
    slowest = D.all_reduce_max(torch.tensor([seconds[k] for k in names], dtype=torch.float64))
    return {
        "switch/sync_bytes": switch.bytes.get("sync_weights", 0),
        **{k: slowest[i].item() for i, k in enumerate(names)},
    }
