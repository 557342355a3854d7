"""Tiny random-weight models saved as ordinary Hugging Face directories.

Nothing can be downloaded here, so demos and tests build a small Qwen2-architecture
model and a word-level tokenizer in code, then save both with `save_pretrained`.
The trainer loads them back through the same `models.loading` path a real
checkpoint takes: no special case for tiny models anywhere else.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"


def build_word_tokenizer(words: Sequence[str]):
    """A whitespace word-level tokenizer: ids 0..2 are <pad>, <eos>, <bos>, then `words`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, BOS, "<unk>", *words])}
    if len(vocab) != len(words) + 4:
        raise ValueError("tokenizer words must be unique and must not repeat the special tokens")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token="<unk>")


def build_tiny_model_dir(
    path: str,
    words: Sequence[str],
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 256,
    seed: int = 0,
    overwrite: bool = False,
) -> str:
    """Save a random-init Qwen2 causal LM plus tokenizer to `path` (atomically); return `path`.

    Re-running with the same arguments and seed gives bit-identical weights.
    """
    if os.path.isfile(os.path.join(path, "config.json")) and not overwrite:
        return path
    return save_random_qwen2(
        path,
        build_word_tokenizer(words),
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        intermediate_size or 4 * hidden_size,
        max_positions,
        seed,
    )


def save_random_qwen2(
    path: str,
    tokenizer,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_positions: int,
    seed: int,
) -> str:
    """A seeded random-init Qwen2 over `tokenizer`'s vocabulary and special tokens, saved with it (atomically)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hybrid_rl.models.saving import atomic_dir, save_weights_quietly

    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with atomic_dir(path) as tmp:  # a crash never leaves a half-written model dir
        save_weights_quietly(model, tmp)
        tokenizer.save_pretrained(tmp)
    return path
