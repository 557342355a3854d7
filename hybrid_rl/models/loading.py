"""Load a Hugging Face causal LM and its tokenizer from a local directory.

Bad input is caught here, before any training step: a missing directory, a
directory without weights, a tokenizer without an EOS or pad token.
"""
from __future__ import annotations

import glob
import os

import torch


def _require_model_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist (config key 'model.path')")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face model directory")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise FileNotFoundError(
            f"{path!r} has no *.safetensors weights; convert the checkpoint with "
            "`model.save_pretrained(path, safe_serialization=True)`"
        )


def load_tokenizer(path: str):
    """Load the tokenizer and check the tokens the trainer depends on."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist (config key 'model.path')")
    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token_id is None:
        raise ValueError(
            f"tokenizer in {path!r} has no EOS token: generation could never stop. "
            "Set `eos_token` in its tokenizer_config.json"
        )
    if tok.pad_token_id is None:
        raise ValueError(
            f"tokenizer in {path!r} has no pad token: batches cannot be padded. "
            "Set `pad_token` in its tokenizer_config.json (many recipes reuse an unused special token)"
        )
    return tok


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load weights from local safetensors into a CPU module (placement and sharding come later)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    _require_model_dir(path)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model.config.use_cache = False  # training default; the rollout engine asks for its cache explicitly
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (the FSDP2 wrapping unit)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `.model.layers`; cannot find its decoder layers to shard")
    return list(layers)
