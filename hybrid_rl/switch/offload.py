"""Move training state between the compute device and host memory, per role.

Roles: optimizer state, policy parameter shards, reference model, reward model.
Gradients are never offloaded: the phase switch frees them (set_to_none).

On CUDA the host side is pinned memory, allocated once per tensor and reused every
step (no allocator churn, no leak), and every copy of a move is issued
non-blocking with one synchronisation at the end. On CPU the device *is* the host,
so a move is a no-op unless `always_copy` is set (tests and the CPU benchmark use it
to run and time the same code path). Every move returns the bytes it copied.

Optimizer state of FSDP2 is DTensors; on the host we keep only each shard's local
tensor plus the DTensor layout, and rebuild the DTensor on the way back, so the
round trip is bit-exact and uses public APIs only.
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


class _Layout:
    """What is needed to rebuild a DTensor from its local shard."""

    def __init__(self, dt: torch.Tensor):
        self.mesh, self.placements = dt.device_mesh, dt.placements
        self.shape, self.stride = dt.shape, dt.stride()

    def rebuild(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)


class OptimizerOffloader:
    """Offload / onload one optimizer's state tensors (all of them, in one sync)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, always_copy: bool = False):
        self.optimizer, self.device, self.always_copy = optimizer, torch.device(device), always_copy
        self.pin = self.device.type == "cuda"
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # reused host buffers
        self._layouts: dict[tuple[int, str], _Layout] = {}
        self.on_device = True

    def _host_buffer(self, key: tuple[int, str], local: torch.Tensor) -> torch.Tensor:
        buf = self._host.get(key)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)
            self._host[key] = buf
        return buf

    def offload(self) -> int:
        if not self.on_device:
            return 0
        moved = 0
        if self.device.type != "cpu" or self.always_copy:
            for state, key, value in optimizer_tensors(self.optimizer):
                k = (id(state), key)
                local = value.to_local() if hasattr(value, "to_local") else value
                if hasattr(value, "to_local"):
                    self._layouts[k] = _Layout(value)
                buf = self._host_buffer(k, local)
                buf.copy_(local, non_blocking=self.pin)
                state[key] = buf
                moved += local.numel() * local.element_size()
            _sync(self.device)
        self.on_device = False
        return moved

    def onload(self) -> int:
        if self.on_device:
            return 0
        moved = 0
        if self.device.type != "cpu" or self.always_copy:
            for state, key, value in optimizer_tensors(self.optimizer):
                k = (id(state), key)
                if value.device.type == "cpu" and self.device.type == "cpu":
                    local = value.clone()  # always_copy on CPU: a real copy, the buffer stays for reuse
                else:
                    local = value.to(self.device, non_blocking=self.pin)
                layout = self._layouts.pop(k, None)
                state[key] = layout.rebuild(local) if layout is not None else local
                moved += local.numel() * local.element_size()
            _sync(self.device)
        self.on_device = True
        return moved

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._host.values())


class ModuleOffloader:
    """Offload / onload a module's parameters and buffers (a reference or reward model,
    or the policy's shards). FSDP2 modules move with `module.to`, as FSDP2 supports."""

    def __init__(self, module: torch.nn.Module, device: torch.device, always_copy: bool = False):
        self.module, self.device, self.always_copy = module, torch.device(device), always_copy
        self._host: dict[int, torch.Tensor] = {}
        self.on_device = True

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]

    def offload(self) -> int:
        from hybrid_rl.models.fsdp import reshard

        reshard(self.module)  # move shards, never gathered copies
        return self._move(torch.device("cpu"), on_device=False)

    def onload(self) -> int:
        return self._move(self.device, on_device=True)

    def _move(self, target: torch.device, on_device: bool) -> int:
        if self.on_device == on_device:
            return 0
        moved = 0
        if self.device.type != "cpu":
            moved = sum(local_bytes(t) for t in self._tensors())
            # To the host the copy blocks: right after `.to()`, FSDP2 re-pads a shard shorter than
            # its padded size (dim 0 not divisible by the world size) with a host-side copy out of
            # the new tensor, which a non-blocking device-to-host copy may not have filled yet.
            # To the device the re-pad runs on the copy's stream, after it: non-blocking is safe.
            self.module.to(target, non_blocking=on_device)
            _sync(self.device)
        elif self.always_copy:
            # CPU: the module cannot leave the host, but the copies are real (into and
            # out of a separate host buffer) so the path is exercised and timed.
            with torch.no_grad():
                for i, t in enumerate(self._tensors()):
                    local = t.to_local() if hasattr(t, "to_local") else t
                    if i not in self._host:
                        self._host[i] = torch.empty_like(local)
                    if on_device:
                        local.copy_(self._host[i])
                    else:
                        self._host[i].copy_(local)
                    moved += local.numel() * local.element_size()
        self.on_device = on_device
        return moved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
