"""Load a Hugging Face causal LM and its tokenizer from a local directory.

Bad input is caught here, before any training step: a missing directory, a
directory without weights, a tokenizer without an EOS or pad token.
"""

from __future__ import annotations

import glob
import json
import os
import warnings

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


def _model_vocab_size(path: str) -> int | None:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def load_tokenizer(path: str):
    """Load the tokenizer and check the tokens the trainer depends on.

    Some tokenizer classes invent a default special token when the config has none
    (Qwen2's adds '<|endoftext|>'); an id outside the model's vocabulary counts as
    missing, since the model could never embed or emit it.
    """
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist (config key 'model.path')")
    tok = AutoTokenizer.from_pretrained(path)
    vocab = _model_vocab_size(path)

    def missing(name: str) -> str | None:
        tid = getattr(tok, f"{name}_id")
        if tid is None:
            return ""
        if vocab is not None and tid >= vocab:
            return f" (only a class default {getattr(tok, name)!r}, id {tid}, outside the model's vocab_size {vocab})"
        return None

    why = missing("eos_token")
    if why is not None:
        raise ValueError(
            f"tokenizer in {path!r} has no EOS token{why}: generation could never stop. "
            "Set `eos_token` in its tokenizer_config.json"
        )
    why = missing("pad_token")
    if why is not None:
        # As TRL and verl do (Llama 3 and Mistral tokenizers have none): padding positions are always masked
        # here (attention masks and response lengths, never a comparison with the pad id), so EOS serves.
        warnings.warn(
            f"tokenizer in {path!r} has no pad token{why}: padding with its EOS token {tok.eos_token!r} "
            "(padding is masked, so no result changes); set `pad_token` in its tokenizer_config.json "
            "to choose another"
        )
        tok.pad_token = tok.eos_token
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


def model_config(model: torch.nn.Module):
    """The transformers config of a (possibly wrapped) model: the first module that has one, or None."""
    return next((m.config for m in model.modules() if hasattr(m, "config")), None)


def attention_implementation(model: torch.nn.Module) -> str:
    return getattr(model_config(model), "_attn_implementation", None) or "eager"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (the FSDP2 wrapping unit)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `.model.layers`; cannot find its decoder layers to shard")
    return list(layers)


def model_eos_ids(path: str) -> set[int]:
    """The EOS ids a Hugging Face model directory declares: config.json's and generation_config.json's
    `eos_token_id` (an int or a list). SGLang stops on all of them whatever the request says; an
    instruct model often lists two (Qwen2.5: <|im_end|> and <|endoftext|>), one of which is not its
    tokenizer's eos_token."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        with open(file) as f:
            value = json.load(f).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def all_full_attention(model: torch.nn.Module) -> bool:
    """True when every layer of the (possibly wrapped) model attends to the whole past.

    The lean step needs it, and so do the engine's ready 4-D decode mask and its CUDA
    graphs: transformers' own mask builder is the only one that knows sliding windows.
    """
    config = model_config(model)
    if config is None:
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    # Configs without layer_types (Llama, Mistral): a window or chunk applies to every layer.
    return getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None
