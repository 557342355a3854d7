"""Write a normal Hugging Face directory from a sharded checkpoint, on a CPU, in one process.

    python -m hybrid_rl.export <checkpoint> <hf_dir> [--dtype auto|float32|bfloat16|float16] [--merge]

<checkpoint> is a step_* directory (or a checkpoints root: its newest complete one).
The model is built on the meta device from the checkpoint's own config.json, given
host memory, and filled from the DCP shards by parameter name; no process group, no
GPU, no gather. `Trainer.save_pretrained` (the recipes' final save) calls the same
`export_checkpoint`.

A LoRA checkpoint (model.lora.rank > 0) holds the adapters only: the export reads the frozen base from
the run's model.path (recorded in meta.json), injects the adapters (models/lora.py) and writes a peft
adapter directory (adapter_config.json + adapter_model.safetensors + tokenizer; what
`PeftModel.from_pretrained` and vLLM's LoRARequest read), or with --merge the base with the adapters
merged in (peft's merge), a plain Hugging Face model directory.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from hybrid_rl.checkpoint import sharded as ckpt
from hybrid_rl.models.saving import declared_dtype, write_hf_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve(path: str) -> str:
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    newest = ckpt.latest(path)
    if newest is None:
        ckpt.read_meta(path)  # raises with the reason (missing, or incomplete)
    return newest


def verified(path: str) -> str:
    """The checkpoint the CLI exports, checked against its manifest: a step_* directory must be intact (the
    error names each damaged file and the older checkpoint to use); a checkpoints root gives its newest intact
    one, naming any newer damaged one it skips. (One process: the verification's collectives are no-ops.)"""
    if os.path.isfile(os.path.join(path, "meta.json")) or ckpt.is_step_dir(path):
        ckpt.check_intact(path, os.path.dirname(os.path.normpath(path)))
        return path
    newest, damaged = ckpt.newest_intact(path)
    for skipped, problems in damaged:
        print(f"export: skipping damaged {skipped} ({ckpt.describe_damage(problems)})", file=sys.stderr)
    return newest or path


def _target_dtype(config, dtype: str) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    return DTYPES.get(declared_dtype(config.to_dict()) or "float32", torch.float32)


def export_checkpoint(checkpoint: str, out: str, dtype: str = "auto", merge: bool = False) -> str:
    """The policy of `checkpoint` as a HF directory at `out` (written atomically); returns `out`.

    dtype: "auto" = the dtype the model's config.json declares (float32 if none).
    merge: a LoRA checkpoint as the merged model instead of a peft adapter directory (module docstring)."""
    from torch.distributed.checkpoint import load as dcp_load
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use auto or one of {sorted(DTYPES)}")
    path = _resolve(checkpoint)
    meta = ckpt.read_meta(path)
    hf = os.path.join(path, "hf")
    config = AutoConfig.from_pretrained(hf)
    target = _target_dtype(config, dtype)  # before from_config(dtype=float32) overwrites config.dtype
    lora = meta.get("config", {}).get("model", {}).get("lora", {})
    if lora.get("rank", 0) > 0:
        return export_lora(path, out, meta["config"]["model"], target, merge, AutoTokenizer.from_pretrained(hf))
    if merge:
        raise ValueError(
            f"--merge: checkpoint {path!r} is not a LoRA run (model.lora.rank 0): its export is the "
            "whole model already; drop --merge"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    state = model.state_dict()
    # Tied weights appear under one name in the checkpoint and two in state_dict(): load the
    # names the checkpoint has and let tie_weights() point the others at them.
    from torch.distributed.checkpoint import FileSystemReader

    saved = set(FileSystemReader(os.path.join(path, "state")).read_metadata().state_dict_metadata)
    wanted = {k: v for k, v in state.items() if f"model.{k}" in saved}
    missing = sorted(k for k in state if f"model.{k}" not in saved and not _is_tied(model, k))
    if missing:
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} has no weights for {missing[:5]} "
            f"({len(missing)} missing); it was not written for this model"
        )
    with ckpt.quiet_single_process():  # no_dist: one process is the intent, DCP's warning says it again
        dcp_load({"model": wanted}, checkpoint_id=os.path.join(path, "state"), no_dist=True)
    model.tie_weights()
    full = {k: v.to(target) for k, v in model.state_dict().items()}
    return write_hf_dir(model, full, AutoTokenizer.from_pretrained(hf), out)


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(tied, dict):
        tied = list(tied)
    return name in tied


# -- a LoRA checkpoint: the run's frozen base + the checkpoint's adapters, as a peft adapter directory or merged
def export_lora(path: str, out: str, model_cfg: dict, dtype: torch.dtype, merge: bool, tokenizer) -> str:
    """Write the LoRA policy of checkpoint `path` (its run's config.model: `model_cfg`) to `out`, in `dtype`;
    returns `out`. The base is read from model_cfg["path"], which must still hold the run's base model."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from hybrid_rl.config.schema import LoraSettings
    from hybrid_rl.models import lora as L
    from hybrid_rl.models.loading import load_causal_lm

    base = model_cfg["path"]
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} is a LoRA run's: it holds the adapters only, and its base model {base!r} (the run's "
            "model.path) is not here; put the base model there (or link it) and export again"
        )
    model = L.apply_lora(load_causal_lm(base, torch.float32), LoraSettings(**model_cfg["lora"]))
    saved = set(FileSystemReader(os.path.join(path, "state")).read_metadata().state_dict_metadata)
    wanted = {n: p.detach() for n, p in model.named_parameters() if L.peft_name(n)}
    missing = sorted(n for n in wanted if f"model.{n}" not in saved)
    if missing:
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} has no adapter weights for {missing[:3]} ({len(missing)} "
            "missing); it was not written with these model.lora settings"
        )
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


# -- PPO's critic (issue 36), on request: the run's critic directory + the checkpoint's critic weights
def export_critic(checkpoint: str, out: str) -> str:
    """Write the critic of a PPO checkpoint (algorithm.advantage=gae) to `out` as models/value.py saves one (the
    body as a Hugging Face directory, value_head.safetensors beside it); returns `out`. The body's architecture is
    read from the run's critic.path (or model.path), which must still hold it, as for a LoRA export's base."""
    from torch.distributed.checkpoint import load as dcp_load
    from transformers import AutoTokenizer

    from hybrid_rl.models.value import load_value_model, save_value_model

    path = _resolve(checkpoint)
    cfg = ckpt.read_meta(path).get("config", {})
    if cfg.get("algorithm", {}).get("advantage") != "gae":
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} has no critic: its run trained algorithm.advantage="
            f"{cfg.get('algorithm', {}).get('advantage')!r}, not gae; drop --critic"
        )
    base = cfg.get("critic", {}).get("path") or cfg["model"]["path"]
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise ckpt.CheckpointError(
            f"checkpoint {path!r}: the critic's architecture is read from {base!r} (the run's critic.path or "
            "model.path), which is not here; put that directory back (or link it) and export again"
        )
    model = load_value_model(base)
    wanted = {n: p.detach() for n, p in model.named_parameters()}
    with ckpt.quiet_single_process():
        dcp_load({"critic": wanted}, checkpoint_id=os.path.join(path, "state"), no_dist=True)  # in place
    return save_value_model(model, out, AutoTokenizer.from_pretrained(os.path.join(path, "hf")))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_rl.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step_* checkpoint directory, or a checkpoints root (its newest)")
    parser.add_argument("out", help="the Hugging Face directory to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint: write the base with the adapters merged (default: a peft adapter dir)",
    )
    parser.add_argument(
        "--critic", metavar="DIR", help="a PPO checkpoint: also write its critic (body + value head) to DIR"
    )
    args = parser.parse_args(argv)
    try:
        checkpoint = verified(args.checkpoint)
        out = export_checkpoint(checkpoint, args.out, args.dtype, args.merge)
        if args.critic:
            print(f"wrote {export_critic(checkpoint, args.critic)} (the critic)")
    except (ckpt.CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
