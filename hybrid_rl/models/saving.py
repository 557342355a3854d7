"""Write ordinary Hugging Face directories (safetensors + config + tokenizer).

A directory is written next to its target and renamed into place, so an interrupted
save never leaves a half-written model where a finished one is expected.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator

import torch

from hybrid_rl.runtime import distributed as D


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (a collective when the model is sharded)."""
    if D.is_dist():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _hf_class_name(model: torch.nn.Module) -> str:
    """FSDP2 swaps in a subclass named FSDP<Class>; the checkpoint must name the original."""
    for cls in type(model).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


@contextlib.contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """Yield a temporary directory next to `path`; on success it replaces `path` in one rename.

    A crash or an exception inside leaves `path` as it was (never half-written)."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        yield tmp
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)


def write_hf_metadata(model: torch.nn.Module, tokenizer, path: str, dtype: str | None = None) -> None:
    """config.json (+ generation config) and the tokenizer of `model`, as a HF directory holds them.

    dtype: the dtype config.json declares (the source model's, e.g. "bfloat16"); None = the config
    as it is in memory, which says float32 for a policy loaded in fp32 to train."""
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _fix_config(os.path.join(path, "config.json"), _hf_class_name(model), dtype)


def declared_dtype(config: dict) -> str | None:
    """The dtype a config.json declares ("dtype", or the older "torch_dtype"), or None."""
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value).replace("torch.", "") if value is not None else None


def _fix_config(cfg_path: str, architecture: str, dtype: str | None = None) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = [architecture]
    cfg["use_cache"] = True  # training turned it off; inference wants it
    if dtype is not None:  # both spellings, so that old and new transformers read the same
        cfg["dtype"] = dtype
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = dtype
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def save_weights_quietly(model: torch.nn.Module, path: str, **kwargs) -> None:
    """model.save_pretrained(path, safe_serialization=True) without transformers 5's "Writing model shards"
    progress bar, which a log file shows as one cluttered line per save (the library says what it saved)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path, safe_serialization=True, **kwargs)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def write_hf_dir(model: torch.nn.Module, state: dict[str, torch.Tensor], tokenizer, path: str) -> str:
    """Write `state` (full weights on the host) as the weights of `model`'s HF directory at `path`, atomically."""
    # save_pretrained declares the module's dtype (fp32 while training); declare the weights' own.
    written = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    with atomic_dir(path) as tmp:
        save_weights_quietly(model, tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        _fix_config(
            os.path.join(tmp, "config.json"),
            _hf_class_name(model),
            str(written).replace("torch.", "") if written is not None else None,
        )
    return path


def save_pretrained(model: torch.nn.Module, tokenizer, path: str) -> str:
    """Write `model` (+ tokenizer) to `path` as a HF directory; returns `path`. All ranks must call it.

    Gathers the full weights (a collective); the trainer saves through a checkpoint and
    `export.py` instead, which never gathers the model on one rank."""
    state = full_state_dict(model)
    if D.is_main():
        write_hf_dir(model, state, tokenizer, path)
    D.barrier()
    return path
