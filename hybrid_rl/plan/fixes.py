"""When a plan does not fit: the smallest changes that make it fit, ranked (torch-free).

`python -m hybrid_rl.plan` and `recipes/grpo_7b.py --dry-run` print them under a plan that does not
fit, each with the plan line it would give. The knobs, in the order they are ranked, least change
to the run first:

  offload  offload flags not yet set (the fewest; they cost host transfers, not results)
  batch    fewer prompts per step (halved until it fits): the same algorithm, noisier steps
  n        fewer samples per prompt (down to 2, the least a group baseline needs)
  tp       rollout tensor parallelism (an engine with its own copy: SGLang, vLLM), doubled
  gpus     more GPUs, doubled up to MAX_GPUS
  lora     LoRA adapters over a frozen base (LORA_RANKS, largest that fits): a different training

Each knob but offload is changed alone, plus the fewest offload flags it then still needs; a knob is
listed once, at its first value that fits (the smallest change), and not at all where it fits only by
the flags that fit alone (it would add nothing). No fix names a flag or value already configured. The
caller says how it plans (`plan_fn`) and how it names a change (`namer`): the CLI's flags or the config's
keys.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

from hybrid_rl.plan.memory import OFFLOAD_FLAGS, MemoryPlan

KNOBS = ("offload", "batch", "n", "tp", "gpus", "lora")
MAX_GPUS = 64
LORA_RANKS = (64, 32, 16, 8)
MIN_N = 2


@dataclass(frozen=True)
class Setting:
    """The planner inputs a fix may change. prompts x n sequences per step; lora_rank 0 = full training."""

    n_gpus: int
    prompts: int
    n: int
    tp_size: int
    lora_rank: int
    offload: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Fix:
    knob: str
    change: str  # in the caller's words (namer)
    setting: Setting
    plan: MemoryPlan


PlanFn = Callable[[Setting], MemoryPlan]
Namer = Callable[[str, Setting, Setting], str]  # (knob, from, to) -> the change to make


def _with_offload(plan_fn: PlanFn, s: Setting) -> tuple[Setting, MemoryPlan] | None:
    """s with the fewest extra offload flags (in OFFLOAD_FLAGS order on a tie) that make every phase fit, or None."""
    unset = [f for f in OFFLOAD_FLAGS if not s.offload.get(f)]
    for k in range(len(unset) + 1):
        for extra in itertools.combinations(unset, k):
            t = dataclasses.replace(s, offload={**s.offload, **{f: True for f in extra}})
            plan = plan_fn(t)
            if plan.fits_all:
                return t, plan
            if k == 0 and "reward_model" in unset and not plan.reward_params:
                unset.remove("reward_model")  # no reward model: its flag changes nothing
    return None


def _values(knob: str, s: Setting, tp_ok: bool, n_ok: bool, max_tp: int) -> Iterator[Setting]:
    """The values a knob tries, smallest change first."""
    r = dataclasses.replace
    if knob == "batch":
        p = s.prompts // 2
        while p >= 1:
            yield r(s, prompts=p)
            p //= 2
    elif knob == "n" and n_ok:
        yield from (r(s, n=n) for n in range(s.n - 1, MIN_N - 1, -1))
    elif knob == "tp" and tp_ok:
        t = s.tp_size * 2
        while t <= min(s.n_gpus, max_tp):
            if s.n_gpus % t == 0:
                yield r(s, tp_size=t)
            t *= 2
    elif knob == "gpus":
        g = s.n_gpus * 2
        while g <= MAX_GPUS:
            yield r(s, n_gpus=g)
            g *= 2
    elif knob == "lora" and not s.lora_rank:
        yield from (r(s, lora_rank=k) for k in LORA_RANKS)


def search_fixes(
    plan_fn: PlanFn,
    start: Setting,
    namer: Namer,
    *,
    tp_ok: bool = True,
    n_ok: bool = True,
    max_tp: int = 8,
    limit: int = 5,
) -> list[Fix]:
    """The first `limit` fixes in KNOBS order (module docstring); [] when `start` already fits or nothing does."""
    if plan_fn(start).fits_all:
        return []
    fixes: list[Fix] = []
    offload_alone: set | None = None  # the flags the offload-only fix adds, once found
    for knob in KNOBS:
        tries = [start] if knob == "offload" else _values(knob, start, tp_ok, n_ok, max_tp)
        for s in tries:
            found = _with_offload(plan_fn, s)
            if not found:
                continue
            t, plan = found
            added = {f for f in OFFLOAD_FLAGS if t.offload.get(f) and not start.offload.get(f)}
            if knob == "offload":
                offload_alone = added
            elif offload_alone is not None and added >= offload_alone:
                continue  # fits only by the offload that fits alone: this knob's change adds nothing; try more
            parts = [] if knob == "offload" else [namer(knob, start, dataclasses.replace(t, offload=start.offload))]
            parts += [namer("offload", start, t)] if added else []
            fixes.append(Fix(knob, " ".join(parts), t, plan))
            break
    return fixes[:limit]
