"""The memory ledger: bytes resident on the compute device per role, at every phase boundary.

Counts come from the tensors themselves (so they work on CPU and match the planner's
formulas), and on CUDA also from the allocator: `memory_allocated` (live tensors) and
`memory_reserved` (what the allocator holds from the device, its cache included), each with
its peak since the previous boundary. Reserved is the number another process competes with:
SGLang sizes its pool from what is free at its start and cannot use this process's cache,
which is why the phase switch gives the cache back (`release_cached`) before an engine
with its own memory resumes. `ROLES` is imported from `hybrid_rl.plan.memory`, its one
definition: the ledger and the plan cannot drift apart, and the planner stays
torch-free for `python -m hybrid_rl.plan`.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from hybrid_rl.plan.memory import ROLES
from hybrid_rl.switch.offload import local_bytes, optimizer_tensors

__all__ = ["ROLES", "MemoryLedger", "Snapshot", "grad_bytes", "module_bytes", "optimizer_bytes", "release_cached"]


def _on(t: torch.Tensor, device: torch.device) -> bool:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.device.type == device.type


def module_bytes(module: Optional[torch.nn.Module], device: torch.device) -> int:
    if module is None:
        return 0
    return sum(local_bytes(p) for p in module.parameters() if _on(p, device))


def grad_bytes(module: torch.nn.Module, device: torch.device) -> int:
    return sum(local_bytes(p.grad) for p in module.parameters() if p.grad is not None and _on(p.grad, device))


def optimizer_bytes(opt: torch.optim.Optimizer, device: torch.device) -> int:
    return sum(local_bytes(v) for _, _, v in optimizer_tensors(opt) if _on(v, device))


def release_cached(device: torch.device) -> int:
    """Give the device memory torch's allocator caches (freed, but kept for reuse) back to the driver, so that
    another process or memory pool can have it; returns the bytes given back (0 off CUDA). The collection first:
    a reference cycle can keep a freed tensor's block alive; the sync: a block still in use by queued kernels is
    not released. Acts on the current device, the rank's own (distributed.init sets it)."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    return max(0, before - torch.cuda.memory_reserved(device))


@dataclass
class Snapshot:
    label: str  # "<phase>:<moment>", e.g. "rollout:generated"
    rollout: int  # the phase switch's rollout count (`PhaseManager.rollouts`) when it was taken
    roles: dict[str, int]
    allocated: Optional[int] = None  # CUDA allocator, bytes
    peak: Optional[int] = None  # CUDA peak since the previous snapshot
    reserved: Optional[int] = None  # CUDA allocator: bytes held from the device (live + cached)
    reserved_peak: Optional[int] = None  # its peak since the previous snapshot

    @property
    def total(self) -> int:
        return sum(self.roles.values())


@dataclass
class MemoryLedger:
    device: torch.device
    snapshots: list[Snapshot] = field(default_factory=list)
    keep_rollouts: int = 2  # older rollouts are dropped so a long run does not grow the ledger

    def record(self, label: str, rollout: int, roles: dict[str, int]) -> Snapshot:
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown memory roles {sorted(unknown)}; valid: {list(ROLES)}")
        snap = Snapshot(label, rollout, {r: int(roles.get(r, 0)) for r in ROLES})
        if self.device.type == "cuda":
            snap.allocated = torch.cuda.memory_allocated(self.device)
            snap.peak = torch.cuda.max_memory_allocated(self.device)
            snap.reserved = torch.cuda.memory_reserved(self.device)
            snap.reserved_peak = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # both peaks
        self.snapshots.append(snap)
        if self.snapshots[0].rollout < rollout - self.keep_rollouts + 1:
            self.snapshots = [s for s in self.snapshots if s.rollout > rollout - self.keep_rollouts]
        return snap

    def rollout_snapshots(self, rollout: int) -> list[Snapshot]:
        return [s for s in self.snapshots if s.rollout == rollout]

    def rollout_metrics(self, rollout: int) -> dict[str, float]:
        """Per-role peak over one cycle's boundaries (that rollout, then its update), and the peak total, in bytes."""
        snaps = self.rollout_snapshots(rollout)
        out: dict[str, float] = {}
        for r in ROLES:
            out[f"memory/{r}_peak"] = float(max((s.roles[r] for s in snaps), default=0))
        out["memory/total_peak"] = float(max((s.total for s in snaps), default=0))
        if snaps and snaps[-1].allocated is not None:
            out["memory/cuda_allocated"] = float(snaps[-1].allocated)
            out["memory/cuda_peak"] = float(max(s.peak or 0 for s in snaps))
            out["memory/cuda_reserved"] = float(snaps[-1].reserved or 0)
            out["memory/cuda_reserved_peak"] = float(max(s.reserved_peak or 0 for s in snaps))
        return out

    def table(self, rollout: int) -> str:
        snaps = self.rollout_snapshots(rollout)
        cuda = bool(snaps) and snaps[0].allocated is not None  # the allocator's view beside the roles' sum
        w = {r: max(16, len(r) + 2) for r in ROLES}  # every column wider than its name
        head = f"{'boundary':<22}" + "".join(f"{r:>{w[r]}}" for r in ROLES) + f"{'total':>12}"
        head += f"{'allocated':>12}{'reserved':>12}{'reserved peak':>15}" if cuda else ""
        rows = [head + "   (MB)"]
        for s in snaps:
            cells = "".join(f"{s.roles[r] / 1e6:>{w[r]}.2f}" for r in ROLES)
            row = f"{s.label:<22}" + cells + f"{s.total / 1e6:>12.2f}"
            if cuda:
                reserved, reserved_peak = (s.reserved or 0) / 1e6, (s.reserved_peak or 0) / 1e6
                row += f"{s.allocated / 1e6:>12.2f}{reserved:>12.2f}{reserved_peak:>15.2f}"
            rows.append(row)
        return "\n".join(rows)

    def write_report(self, rollout: int, out_dir: str, header: str) -> None:
        """memory.txt (header, then the cycle's table) and memory_timeline.png in out_dir; nothing if no snapshots."""
        if not self.rollout_snapshots(rollout):
            return
        with open(os.path.join(out_dir, "memory.txt"), "w") as f:
            f.write(f"{header}\n\n{self.table(rollout)}\n")
        self.plot(rollout, os.path.join(out_dir, "memory_timeline.png"))

    def plot(self, rollout: int, path: str) -> None:
        """Memory timeline of one cycle: one lane per role, one column per phase boundary."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        snaps = self.rollout_snapshots(rollout)
        if not snaps:
            raise ValueError(f"no memory snapshots recorded for rollout {rollout}")
        scale = max(max(s.roles[r] for s in snaps for r in ROLES), 1)
        fig, ax = plt.subplots(figsize=(1.4 * len(snaps) + 3, 0.55 * len(ROLES) + 1.5))
        cmap = plt.get_cmap("tab10")
        for lane, role in enumerate(ROLES):
            for x, s in enumerate(snaps):
                b = s.roles[role]
                if b:
                    h = 0.15 + 0.7 * b / scale
                    ax.add_patch(plt.Rectangle((x, lane - h / 2), 1, h, color=cmap(lane), alpha=0.8))
                    ax.text(x + 0.5, lane, f"{b / 1e6:.1f}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, len(snaps))
        ax.set_ylim(-0.6, len(ROLES) - 0.4)
        ax.set_yticks(range(len(ROLES)), ROLES)
        ax.set_xticks(
            [x + 0.5 for x in range(len(snaps))], [s.label for s in snaps], rotation=30, ha="right", fontsize=8
        )
        ax.invert_yaxis()
        ax.set_title(f"device memory per role at each phase boundary, rollout {rollout} (MB; bar height ~ bytes)")
        fig.tight_layout()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
