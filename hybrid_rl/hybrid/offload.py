"""Move training state between the compute device and host memory.

Every function returns the number of bytes it moved, so the phase switch can
report bandwidth. DTensor shards are moved shard-locally (no communication).
"""
from __future__ import annotations

from typing import Iterator

import torch


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t` (its shard, if `t` is a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def optimizer_tensors(opt: torch.optim.Optimizer) -> Iterator[tuple[dict, str, torch.Tensor]]:
    for state in opt.state.values():
        for key, value in state.items():
            # Adam's `step` is a CPU scalar by design (capturable=False); leave it there.
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield state, key, value


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device | str, non_blocking: bool = False) -> int:
    moved = 0
    device = torch.device(device)
    for state, key, value in optimizer_tensors(opt):
        if value.device != device:
            state[key] = value.to(device, non_blocking=non_blocking)
            moved += local_bytes(value)
    if non_blocking and torch.cuda.is_available():
        torch.cuda.synchronize()
    return moved


def move_module(module: torch.nn.Module, device: torch.device | str) -> int:
    """Move a module's parameters and buffers; returns bytes moved (0 if already there)."""
    device = torch.device(device)
    moved = sum(local_bytes(t) for t in [*module.parameters(), *module.buffers()] if t.device != device)
    if moved:
        module.to(device)
    return moved


def optimizer_state_device(opt: torch.optim.Optimizer) -> torch.device | None:
    for _, _, value in optimizer_tensors(opt):
        return value.device
    return None
