"""Parallelism is applied here and nowhere else: FSDP2 `fully_shard` per decoder
layer, then the root. On one rank (a notebook) the module stays a plain module.
"""
from __future__ import annotations

import torch

from hybrid_rl import distributed as D
from hybrid_rl.models.loading import decoder_layers


def shard_model(model: torch.nn.Module, device: torch.device, mixed_precision: bool) -> torch.nn.Module:
    """Move `model` to `device` and shard it over all ranks (no-op sharding on one rank).

    mixed_precision: bf16 compute/communication for parameters, fp32 gradient
    reduction; the sharded parameters (the optimizer's master copy) stay fp32.
    """
    model.to(device)
    if not D.is_dist():
        if mixed_precision:
            raise ValueError("bf16 mixed precision needs FSDP2; launch with torchrun or use model.dtype=float32")
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def gather_full_weights(model: torch.nn.Module, keep_resident: bool) -> None:
    """Make every parameter whole on this rank (all-gather the shards).

    With keep_resident the unsharded weights stay until `release_full_weights`, so
    forward passes in between (token-by-token decoding) run no collectives.
    """
    for m in fsdp_modules(model):
        m.set_reshard_after_forward(not keep_resident, recurse=False)
    for m in fsdp_modules(model):
        m.unshard()


def release_full_weights(model: torch.nn.Module) -> None:
    """Free the gathered copies: back to 1/world of the weights per rank.

    Each module gets FSDP2's default back: reshard after forward, except the root, whose
    parameters (embeddings, LM head, final norm) a backward gathers again right away.
    """
    for m in fsdp_modules(model):
        m.reshard()
        m.set_reshard_after_forward(m is not model, recurse=False)


def reshard(model: torch.nn.Module) -> None:
    """Free any gathered parameters of an FSDP2 module (no-op if none, or if not sharded)."""
    for m in fsdp_modules(model):
        m.reshard()
