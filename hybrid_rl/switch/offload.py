"""Move training state between the compute device and host memory, per role.

Roles: optimizer state, policy parameter shards, reference model, reward model.
Gradients are never offloaded: the phase switch frees them (set_to_none).

On CUDA the host side is pinned memory, one flat buffer per optimizer and per module, allocated
once and reused every step (no allocator churn, no leak), and every copy
of a move is issued non-blocking with one synchronisation at the end. On CPU the device *is* the host,
so a move is a no-op unless `always_copy` is set (tests and the CPU benchmark use it
to run and time the same code path). Every move returns the bytes it copied.

Optimizer state of FSDP2 is DTensors; on the host we keep only each shard's local
tensor plus the DTensor layout, and rebuild the DTensor on the way back, so the
round trip is bit-exact and uses public APIs only.
"""

from __future__ import annotations

import types
import warnings
import weakref
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

        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


class OptimizerOffloader:
    """Offload / onload one optimizer's state tensors (all of them, in one sync).

    The host side is ONE flat buffer (pinned on CUDA) holding every state tensor at its own aligned offset, allocated
    at the first offload and reused by every later one; while offloaded, each state entry is a view into it. Not a
    buffer per tensor: torch's pinned allocator rounds every request up to a power of two and keeps each block for
    good, so hundreds of per-tensor blocks (two per parameter for AdamW) cost hundreds of page-locking calls and
    could hold up to twice the state in pinned memory, while one block is rounded once (ModuleOffloader does the
    same). A state that changes shape (a parameter group added) gets a new buffer of the new size."""

    _ALIGN = 512  # bytes between the starts of two tensors in the buffer (DMA-friendly; any dtype view is aligned)

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, always_copy: bool = False):
        self.optimizer, self.device, self.always_copy = optimizer, torch.device(device), always_copy
        self.pin = self.device.type == "cuda"
        self._host: torch.Tensor | None = None  # the flat uint8 buffer, reused
        self._layouts: dict[tuple[int, str], _Layout] = {}
        self.on_device = True

    def _plan(self) -> tuple[list[tuple[dict, str, torch.Tensor, torch.Tensor, int]], int]:
        """(state, key, value, its local tensor, byte offset in the buffer) per state tensor, and the buffer's size."""
        entries, total = [], 0
        for state, key, value in optimizer_tensors(self.optimizer):
            local = value.to_local() if hasattr(value, "to_local") else value
            entries.append((state, key, value, local, total))
            total += -(-local.numel() * local.element_size() // self._ALIGN) * self._ALIGN
        return entries, total

    def offload(self) -> int:
        if not self.on_device:
            return 0
        moved = 0
        if self.device.type != "cpu" or self.always_copy:
            entries, total = self._plan()
            if self._host is None or self._host.numel() != total:
                self._host = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=self.pin and total > 0)
            for state, key, value, local, offset in entries:
                if hasattr(value, "to_local"):
                    self._layouts[(id(state), key)] = _Layout(value)
                nbytes = local.numel() * local.element_size()
                host = self._host[offset : offset + nbytes].view(local.dtype).view(local.shape)
                host.copy_(local, non_blocking=self.pin)
                state[key] = host
                moved += nbytes
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
        return 0 if self._host is None else self._host.numel()


class ModuleOffloader:
    """Offload / onload a module's parameters and buffers (a reference or reward model,
    or the policy's shards), keeping every tensor object in place.

    What moves is each tensor's storage: its bytes go into one host buffer (pinned on CUDA,
    allocated at the first offload and reused by every later one), then the storage is
    resized to 0, which frees the device memory; onload resizes it back and copies the bytes
    in. Parameters, their FSDP2 DTensor wrappers, the padded shard FSDP2 all-gathers from
    (the same storage) and optimizer references all stay valid, as when FSDP2 frees its own
    unsharded parameters. `module.to("cpu")` instead allocated fresh pageable host memory
    every step, and its copy back from pageable memory waited for the device.
    While offloaded, a forward of the module raises, saying so, and so do `load_state_dict` (a
    checkpoint load, `set_state_dict`) and `_apply` (`.to()`, `.cuda()`, `.float()`, `to_empty`) on
    it or any of its submodules: both end in FSDP2's `FSDPParam.reset_sharded_param`, whose
    `data_ptr() > 0` test fails for a freed storage, so an uneven shard is re-padded by copying
    from the freed memory (a crash, or garbage), and a load would write into freed storage. A
    storage torch cannot resize (memory-mapped, imported) is copied both ways but keeps its memory.

    free_storage: empty the storages after the copy (None: on a device, not on CPU). On CPU
    with always_copy the copies run but the memory stays by default, so code that writes into
    an offloaded module (tests do, to check the onload overwrites it) writes somewhere, not
    through a freed pointer; tests pass True to run the device's path on CPU.
    """

    _ALIGN = 512  # bytes between the start of two storages in the host buffer (DMA-friendly)

    def __init__(
        self, module: torch.nn.Module, device: torch.device, always_copy: bool = False, free_storage: bool | None = None
    ):
        self.module, self.device, self.always_copy = module, torch.device(device), always_copy
        self.pin = self.device.type == "cuda"
        self.free_storage = self.device.type != "cpu" if free_storage is None else free_storage
        # One flat buffer, not one per tensor: the pinned allocator rounds every request up to a
        # power of two (up to twice the bytes, per request), so one request wastes the least.
        self._host: torch.Tensor | None = None
        self.on_device = True
        self._warned = False
        self._parked_bytes = 0
        parked = _PARKED.pop(module, None)
        if parked is not None:  # offloaded by an earlier offloader (an earlier PhaseManager): resident again
            parked.restore()

    def _storages(self) -> list[torch.UntypedStorage]:
        """Each distinct storage under the module's parameters and buffers (tied weights share one)."""
        seen: dict[int, torch.UntypedStorage] = {}
        for t in [*self.module.parameters(), *self.module.buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            storage = local.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = storage
        return list(seen.values())

    def offload(self) -> int:
        from hybrid_rl.models.fsdp import reshard

        reshard(self.module)  # move shards, never gathered copies
        if not self.on_device:
            return 0
        moved = 0
        if self.device.type != "cpu" or self.always_copy:
            layout, total = [], 0
            for st in self._storages():
                layout.append((st, total, st.nbytes()))
                total += -(-st.nbytes() // self._ALIGN) * self._ALIGN
            if self._host is None or self._host.numel() != total:
                self._host = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            for st, offset, nbytes in layout:
                self._host[offset : offset + nbytes].copy_(_bytes_of(st), non_blocking=self.pin)
            # Free only after the copies landed (the one wait of this move): work on another stream
            # (an FSDP2 all-gather) could still read a block the allocator would hand out again.
            _sync(self.device)
            kept = 0
            for st, _, nbytes in layout:
                if not self.free_storage:
                    pass
                elif st.resizable():
                    st.resize_(0)
                else:  # memory torch does not own (a memory-mapped file, an IPC or DLPack import)
                    kept += nbytes
            if kept and self.device.type != "cpu" and not self._warned:
                self._warned = True
                warnings.warn(
                    f"offload: {kept / 2**20:.1f} MiB of {type(self.module).__name__}'s tensors live in "
                    "memory torch cannot resize (imported or memory-mapped) and stay on the device; "
                    "give the module tensors that torch allocated (e.g. clone them) to free it"
                )
            # prepend: before FSDP2's pre-forward, whose all-gather would fail on the empty shards first
            hooks = [self.module.register_forward_pre_hook(_refuse_offloaded, prepend=True)]
            modules = list(self.module.modules())
            for m in modules:
                hooks.append(m.register_load_state_dict_pre_hook(_refuse_load))
                m._apply = types.MethodType(_refuse_apply, m)  # shadows the class's until the onload
            _PARKED[self.module] = _Parked(
                self._host, layout, hooks, [weakref.ref(m) for m in modules], self.device, self.pin
            )
            # Counted as the planner and the ledger count (each tensor's own bytes); the few bytes of
            # FSDP2's padding at the end of an uneven shard are copied too.
            moved = sum(local_bytes(t) for t in [*self.module.parameters(), *self.module.buffers()])
            self._parked_bytes = moved
        self.on_device = False
        return moved

    def onload(self) -> int:
        if self.on_device:
            return 0
        parked = _PARKED.pop(self.module, None)
        self.on_device = True
        if parked is None:
            return 0
        parked.restore()
        return self._parked_bytes

    def host_bytes(self) -> int:
        return 0 if self._host is None else self._host.numel()


class _Parked:
    """An offloaded module's bytes: the host buffer, where each storage's bytes sit in it, and the
    hook that refuses a forward meanwhile. Kept per module (`_PARKED`, weakly: no reference back
    to the module), so that a later offloader of the module (a second PhaseManager over the same
    reference model) finds it offloaded and brings it back."""

    def __init__(self, host: torch.Tensor, layout: list, hooks: list, modules: list, device: torch.device, pin: bool):
        self.host, self.layout, self.hooks, self.device, self.pin = host, layout, hooks, device, pin
        self.modules = modules  # weak references: the module is this dict entry's key

    def restore(self) -> None:
        for st, offset, nbytes in self.layout:
            if st.nbytes() != nbytes:  # freed at offload (a storage that is not resizable kept its bytes)
                st.resize_(nbytes)
            _bytes_of(st).copy_(self.host[offset : offset + nbytes], non_blocking=self.pin)
        _sync(self.device)  # the host buffer is written again at the next offload
        for hook in self.hooks:
            hook.remove()
        for ref in self.modules:
            m = ref()
            if m is not None and "_apply" in m.__dict__:
                del m._apply


_PARKED: "weakref.WeakKeyDictionary[torch.nn.Module, _Parked]" = weakref.WeakKeyDictionary()


def _refuse_offloaded(module: torch.nn.Module, args) -> None:
    raise RuntimeError(
        f"{type(module).__name__} is offloaded to host memory by the phase switch: run it inside the "
        "phase that holds it (the reference model in `with phases.score()`, the reward model in "
        "`phases.reward()`), or onload it first"
    )


def _refuse_load(module: torch.nn.Module, *args) -> None:
    raise RuntimeError(
        f"load_state_dict on {type(module).__name__}, which is offloaded to host memory by the phase "
        "switch (its device storage is freed, and FSDP2 would re-pad its shards from it): load inside "
        "the phase that holds it (`with phases.train()` for the policy), or onload it first"
    )


def _refuse_apply(module: torch.nn.Module, *args, **kwargs) -> None:
    raise RuntimeError(
        f"{type(module).__name__} is offloaded to host memory by the phase switch, so it cannot be "
        "moved or cast (.to(), .cuda(), .float(), to_empty: FSDP2 would re-pad its shards from freed "
        "storage); do it inside the phase that holds it, or onload it first"
    )


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of `storage` (whatever dtypes its tensors have)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
