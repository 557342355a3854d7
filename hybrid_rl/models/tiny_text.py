"""A tiny random-weight Qwen2 with a tokenizer for real text (GSM8K and the like), built in code.

models/tiny.py's word-level tokenizer knows only the words it is given; this one is
byte-level (every string encodes and decodes back exactly, unicode included), with
two merges so that GSM8K's answer marker `####` is one token, ChatML-style special
tokens and a chat template, so the chat-template path runs as it does for a
Qwen2.5-Instruct checkpoint. Saved as a normal Hugging Face directory.

    python -m hybrid_rl.models.tiny_text runs/tiny_text    # build one from the command line
"""

from __future__ import annotations

import os
import sys

PAD, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"  # pad as in Qwen2.5
# ChatML, as Qwen2.5-Instruct formats a conversation (without its default system turn).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_text_tokenizer():
    """Byte-level BPE: 256 byte symbols + `##` + `####`, then <|endoftext|> (pad), <|im_end|> (EOS), <|im_start|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(alphabet + ["##", "####"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("#", "#"), ("##", "##")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, EOS, IM_START])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_text_model_dir(
    path: str,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 1024,
    seed: int = 0,
    overwrite: bool = False,
) -> str:
    """Save a random-init Qwen2 causal LM plus the byte-level text tokenizer to `path` (atomically)."""
    from hybrid_rl.models.tiny import save_random_qwen2

    if os.path.isfile(os.path.join(path, "config.json")) and not overwrite:
        return path
    return save_random_qwen2(
        path,
        build_text_tokenizer(),
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        4 * hidden_size,
        max_positions,
        seed,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hybrid_rl.models.tiny_text OUT_DIR")
    print(build_tiny_text_model_dir(sys.argv[1]))
