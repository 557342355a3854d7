"""`monkey_patch_torch_reductions` (`srt/utils/patch_torch.py`, note 2.2).

The patch swaps the device index inside a CUDA tensor's pickled rebuild args (arg 6)
for the GPU's uuid, so producer and consumer may number GPUs differently. It is written
for CUDA tensors only: a CPU tensor's reduce args are a 3-tuple, so after the patch
serializing a CPU tensor in the same process raises IndexError (note 7). That hazard
is reproduced as-is; never call this in a process that exports CPU tensors.
"""
from __future__ import annotations

from typing import Union

import torch
from torch.multiprocessing import reductions

# Position of the device in rebuild_cuda_tensor's args (torch 2.13 reductions.reduce_tensor).
_DEVICE_ARG = 6

_originals: dict = {}


def monkey_patch_torch_reductions() -> None:
    """Install the uuid-carrying reducers for this process (idempotent)."""
    if _originals:
        return
    _originals["reduce_tensor"] = reductions.reduce_tensor
    _originals["rebuild_cuda_tensor"] = reductions.rebuild_cuda_tensor
    reductions.reduce_tensor = _reduce_tensor_modified
    reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor_modified
    # ForkingPickler captured the old reducer at import; register the new one.
    reductions.init_reductions()


def _reduce_tensor_modified(tensor):
    rebuild, args = _originals["reduce_tensor"](tensor)
    # No length check, on purpose: CPU tensors fail here with IndexError, as in SGLang.
    device = args[_DEVICE_ARG]
    return rebuild, (*args[:_DEVICE_ARG], _device_to_uuid(device), *args[_DEVICE_ARG + 1:])


def _rebuild_cuda_tensor_modified(*args):
    # CUDA-only path (untestable on a CPU machine): map the uuid back to a local index.
    args = (*args[:_DEVICE_ARG], _device_from_maybe_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return _originals.get("rebuild_cuda_tensor", reductions.rebuild_cuda_tensor)(*args)


def _device_to_uuid(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _device_from_maybe_uuid(device: Union[int, str]) -> int:
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise RuntimeError(f"no local CUDA device has uuid {device!r}")
