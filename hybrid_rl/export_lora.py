"""The export of a LoRA checkpoint (export.py): the run's frozen base + the checkpoint's adapters, written as a
peft adapter directory or merged into a plain Hugging Face model directory. One process, CPU, no gather."""
from __future__ import annotations

import os

import torch

from hybrid_rl import checkpoint as ckpt


def export_lora(path: str, out: str, model_cfg: dict, dtype: torch.dtype, merge: bool, tokenizer) -> str:
    """Write the LoRA policy of checkpoint `path` (its run's config.model: `model_cfg`) to `out`, in `dtype`;
    returns `out`. The base is read from model_cfg["path"], which must still hold the run's base model."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from hybrid_rl.config_lora import LoraSettings
    from hybrid_rl.models import lora as L
    from hybrid_rl.models.loading import load_causal_lm

    base = model_cfg["path"]
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} is a LoRA run's: it holds the adapters only, and its base model {base!r} (the run's "
            "model.path) is not here; put the base model there (or link it) and export again")
    model = L.apply_lora(load_causal_lm(base, torch.float32), LoraSettings(**model_cfg["lora"]))
    saved = set(FileSystemReader(os.path.join(path, "state")).read_metadata().state_dict_metadata)
    wanted = {n: p.detach() for n, p in model.named_parameters() if L.peft_name(n)}
    missing = sorted(n for n in wanted if f"model.{n}" not in saved)
    if missing:
        raise ckpt.CheckpointError(f"checkpoint {path!r} has no adapter weights for {missing[:3]} ({len(missing)} "
                                   "missing); it was not written with these model.lora settings")
    with ckpt.quiet_single_process():  # no_dist: one process is the intent, DCP's warning says it again
        dcp_load({"model": wanted}, checkpoint_id=os.path.join(path, "state"), no_dist=True)  # in place
    model.peft_config[L.ADAPTER].base_model_name_or_path = os.path.abspath(base)
    if merge:
        return _write_merged(model, dtype, tokenizer, out)
    from hybrid_rl.models.saving import atomic_dir

    with atomic_dir(out) as tmp:
        L.save_adapter_dir(model, tmp, dtype)
        tokenizer.save_pretrained(tmp)
    return out


def _write_merged(model: torch.nn.Module, dtype: torch.dtype, tokenizer, out: str) -> str:
    """Merge every adapter into its base layer (peft's `merge`, in fp32), put the plain layers back, write."""
    from peft.tuners.lora import LoraLayer

    from hybrid_rl.models.saving import write_hf_dir

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(safe_merge=True)  # raises on a non-finite merged weight
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    del model.peft_config
    model.tie_weights()
    return write_hf_dir(model, {k: v.to(dtype) for k, v in model.state_dict().items()}, tokenizer, out)
