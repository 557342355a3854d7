"""Parallelism is applied here and nowhere else: FSDP2 `fully_shard` per decoder
layer, then the root. Without a process group (one process on CPU, a notebook) the module
stays a plain module; on one GPU `distributed.init` opens a 1-rank group, and FSDP2 applies
(bf16 mixed precision needs it).

`load_sharded` builds the trainer's models so that only rank 0 ever holds the whole
model: the others build it on the meta device, shard it, and receive their shards from
rank 0 (a 7B policy and its reference in fp32 would otherwise be 2 x 30 GB of host
memory on each of 8 ranks at start-up).

Every model comes out in eval mode. `prepare_policy` readies the policy for training
(dropout off, activation checkpointing switched on); the update (`update.policy_update`)
puts it in train mode for its own duration, which is when the checkpointing acts.
"""

from __future__ import annotations

import copy
import os
from typing import Callable, Optional

import torch

from hybrid_rl.models.loading import decoder_layers, load_causal_lm
from hybrid_rl.runtime import distributed as D


def shard_model(model: torch.nn.Module, device: torch.device, mixed_precision: bool, mesh=None) -> torch.nn.Module:
    """Move `model` to `device` and shard it over all ranks, or over `mesh` (a DeviceMesh: the split
    placement's learner ranks) when given (no-op sharding on one rank).

    mixed_precision: bf16 compute/communication for parameters, fp32 gradient
    reduction; the sharded parameters (the optimizer's master copy) stay fp32.
    """
    model.to(device)
    if not D.is_dist():
        if mixed_precision:
            raise ValueError("bf16 mixed precision needs FSDP2; launch with torchrun or use model.dtype=float32")
        return model
    return _fully_shard(model, mixed_precision, mesh)


def _fully_shard(model: torch.nn.Module, mixed_precision: bool, mesh=None) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp, mesh=mesh)
    fully_shard(model, mp_policy=mp, mesh=mesh)
    return model


def prepare_policy(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Ready the policy for training, before it is sharded (a `load_sharded` prepare function).

    Dropout is forced OFF, whatever the model's config says (the config itself is left as
    it is, so a saved checkpoint keeps the user's value): the update runs in train mode,
    and with dropout on its log-probs would differ from the old-policy and reference
    log-probs scored in eval mode by noise alone, biasing the ratio and the KL (verl turns
    it off for the same reason; TRL offers `disable_dropout`).

    gradient_checkpointing: every decoder layer recomputes its forward in the backward
    instead of keeping its activations (one hidden state per layer is kept). transformers
    only checkpoints a layer that is in train mode, which `update.policy_update` sees to.
    The checkpoint is torch's non-reentrant one (`use_reentrant=False`): the reentrant one
    runs the recompute as a nested backward outside FSDP2's backward hooks and needs an
    input that requires grad.
    """
    disable_dropout(model)
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        # transformers renamed the switch (gradient_checkpointing_enable is a deprecated alias in newer
        # releases); both take the checkpoint's keyword arguments as their first argument.
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable(kwargs)  # raises ValueError for a model class that cannot checkpoint
    return model


def prepare_reference(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Ready the frozen reference (a `load_sharded` prepare function, before sharding): no gradients, eval mode,
    parameters in `dtype`, the inference dtype (bf16 under mixed precision, as verl builds its reference).

    It never trains, so it needs no fp32 master: in fp32 it would hold, offload and onload twice the bytes the
    planner bills (ref = b*N, plan/memory.py) for the same forward, since FSDP2's mixed precision casts every
    gathered parameter to bf16 anyway. Buffers keep their dtype, as `from_pretrained(dtype=bf16)` leaves them
    (the rotary inv_freq stays fp32), so the reference computes what the policy computes. On several ranks the
    meta parameters are cast here and rank 0's fp32 state dict is copied into the bf16 shards (a cast)."""
    model.requires_grad_(False).eval()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every dropout of `model` at probability 0: the dropout modules, and the float rates attention
    modules keep as attributes and pass to the attention function in train mode (`attention_dropout`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def load_sharded(
    path: str,
    device: torch.device,
    mixed_precision: bool,
    attn_implementation: str,
    prepare: list[Callable[[torch.nn.Module], object]],
    *,
    load: Optional[Callable[[], torch.nn.Module]] = None,
    model_class=None,
    dtype: torch.dtype = torch.float32,
    mesh=None,
) -> list[torch.nn.Module]:
    """One sharded model per entry of `prepare` (e.g. the policy and its reference), each holding the
    weights of the Hugging Face directory `path` after `prepare[i]` ran on it (before sharding).

    load: reads the whole model (default: `load_causal_lm(path, dtype, attn_implementation)`);
    model_class: the transformers class the other ranks build it with (default: AutoModelForCausalLM).
    On one rank: loaded once, copied for the others. On several: rank 0 alone reads the weights; every
    rank builds the same modules on the meta device, shards them, allocates its shards on `device` and
    receives them from rank 0 (`set_model_state_dict(broadcast_from_rank0=True)`), buffers included,
    so each rank holds 1/world of every model and rank 0 one whole copy while loading.
    mesh: shard over this DeviceMesh only (the split placement's learner ranks); every rank of it reads the
    weights itself (the broadcast from rank 0 is a collective of the whole world, which the rollout ranks
    do not join), at the cost of one whole copy per learner rank while loading."""
    load = load or (lambda: load_causal_lm(path, dtype, attn_implementation))
    if not D.is_dist() or mesh is not None:
        first = load()
        models = [first] + [copy.deepcopy(first) for _ in prepare[1:]]
        for model, fn in zip(models, prepare):
            fn(model)
        return [shard_model(m, device, mixed_precision, mesh) for m in models]
    from transformers import AutoConfig, AutoModelForCausalLM

    full = _load_on_rank0(load, path)
    config = AutoConfig.from_pretrained(path)
    config.use_cache = False  # as the loaders leave it
    generation = _generation_config(path)
    full_state = full.state_dict() if full is not None else {}
    # Buffers a state dict leaves out (the rotary inv_freq is not persistent) are rank 0's too.
    full_buffers = dict(full.named_buffers()) if full is not None else None
    models = []
    for fn in prepare:
        with torch.device("meta"):
            model = (model_class or AutoModelForCausalLM).from_config(
                config, dtype=dtype, attn_implementation=attn_implementation
            )
        if generation is not None and hasattr(model, "generation_config"):
            model.generation_config = copy.deepcopy(generation)
        model.eval()  # as from_pretrained returns it
        fn(model)
        _fully_shard(model, mixed_precision)
        _receive_from_rank0(model, device, full_state, full_buffers)
        models.append(model)
    del full, full_state, full_buffers
    return models


def _load_on_rank0(load: Callable[[], torch.nn.Module], path: str) -> Optional[torch.nn.Module]:
    """The whole model, read by `load` on rank 0 (None on the other ranks). If rank 0 fails,
    every rank raises: rank 0 its own error, the others a RuntimeError naming it."""
    full, failure = None, None
    if D.is_main():
        try:
            full = load()
        except Exception as err:  # every rank must learn it, or the others wait in the broadcast below
            failure = err
    reason = D.broadcast_object_from(None if failure is None else f"{type(failure).__name__}: {failure}", 0)
    if failure is not None:
        raise failure
    if reason is not None:
        raise RuntimeError(f"rank 0 could not load the model in {path!r} ({reason}); see rank 0's error")
    return full


def _generation_config(path: str):
    """The directory's generation_config.json as a GenerationConfig, or None where it has none."""
    from transformers import GenerationConfig

    if os.path.isfile(os.path.join(path, "generation_config.json")):
        return GenerationConfig.from_pretrained(path)
    return None


def _receive_from_rank0(
    model: torch.nn.Module, device: torch.device, full_state: dict, full_buffers: Optional[dict]
) -> None:
    """Allocate the sharded meta `model`'s shards on `device` and fill them from rank 0's whole
    state dict (`full_state`, empty on the other ranks), then every buffer from rank 0's
    `full_buffers` (None on the other ranks) by broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    # A copy of the dict each time: set_model_state_dict pops the entries it renames.
    set_model_state_dict(
        model, dict(full_state), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if full_buffers is not None:
                buf.copy_(full_buffers[name])
            D.broadcast_tensor_(buf, 0)


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
