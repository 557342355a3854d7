"""Tiny reward models built in code and saved as ordinary Hugging Face directories.

The reward model has a tokenizer of its own, deliberately unlike the policy's
(models/tiny.py): another id for every word, digits split one by one, and a chat
template with role tokens, so a scorer that passed the policy's token ids instead of
re-tokenizing the text would read nonsense and score differently. It is a Llama (the
policy is a Qwen2), as reward models often are; Llama also lets transformers load the
word-level tokenizer as saved (for model_type qwen2 it swaps in Qwen2's byte-level
pre-tokenizer, which loses every word that is not a digit).

    random_reward_model_dir(path)             random LlamaForSequenceClassification (one label)
    random_reward_model_dir(path, "causal_lm") random LlamaForCausalLM, scored by the logit of "yes"
    digits_reward_model_dir(path)             the classifier trained for a few hundred steps to predict
                                              the digits task's reward (rewards/toy.py) from the text

    python -m hybrid_rl.rewards.tiny_model runs/tiny_rm [--steps 500]   # the demo's reward model
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Sequence

import torch

from hybrid_rl.data.digits import DIGIT_WORDS

PAD, UNK, USER, ASSISTANT, END = "<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"
SCORE_TOKEN = "yes"  # the causal-LM variant's score: this token's logit at the last position
# The prompt as the user turn, the completion as the assistant turn, a fixed end token last: the
# classifier reads its score at that token, which has attended to both turns.
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}<|end|>"


def build_reward_tokenizer(words: Sequence[str] = DIGIT_WORDS, chat_template: bool = True):
    """Word-level tokenizer: specials, then `words` reversed (so no id matches the policy's), plus yes/no.

    Digits and punctuation are split off one by one, so "=2" reads as "=", "2".
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [UNK, PAD, USER, ASSISTANT, END]
    vocab = {tok: i for i, tok in enumerate([*specials, *reversed(list(words)), SCORE_TOKEN, "no"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, additional_special_tokens=[USER, ASSISTANT, END]
    )
    if chat_template:
        out.chat_template = CHAT_TEMPLATE
    return out


def _build(kind: str, tokenizer, hidden_size: int, num_layers: int, num_labels: int, seed: int):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    if kind not in ("classifier", "causal_lm"):
        raise ValueError(f"kind must be 'classifier' or 'causal_lm', got {kind!r}")
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=kind == "causal_lm",
        pad_token_id=tokenizer.pad_token_id,
        num_labels=num_labels,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cls = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
        model = cls.from_config(cfg, dtype=torch.float32)
        if kind == "classifier":
            # HF initialises the head with std 0.02: scores of ~1e-3 everywhere. A unit-scale head
            # gives a random model scores that differ between completions, which the tests need.
            torch.nn.init.normal_(model.score.weight, std=1.0 / hidden_size**0.5)
    return model


def _save(model, tokenizer, path: str) -> str:
    from hybrid_rl.models.saving import atomic_dir, save_weights_quietly

    with atomic_dir(path) as tmp:  # a crash never leaves a half-written model dir
        save_weights_quietly(model, tmp)
        tokenizer.save_pretrained(tmp)
    return path


def random_reward_model_dir(
    path: str,
    kind: str = "classifier",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_labels: int = 1,
    seed: int = 0,
    chat_template: bool = True,
    overwrite: bool = False,
) -> str:
    """Save a seeded random-init reward model (`kind`: classifier | causal_lm) with its tokenizer; return `path`."""
    if os.path.isfile(os.path.join(path, "config.json")) and not overwrite:
        return path
    tok = build_reward_tokenizer(chat_template=chat_template)
    return _save(_build(kind, tok, hidden_size, num_layers, num_labels, seed), tok, path)


# -- a reward model whose score means something: trained on the digits task ---------------
def _digits_example(rng: random.Random) -> tuple[str, str, float]:
    """(prompt, completion text, digits reward) with the completion right in a random number of places.

    The reward is rewards/toy.py's, with "stopped right after the answer" read as "exactly
    three digits" (the text a reward model sees has no stop token). A fourth token may be one
    of the policy's special tokens, as the trainer's text keeps them: without those examples
    a policy ending "2 3 4 <unk>" would look as finished as "2 3 4" to the model.
    """
    ds = [rng.randrange(10) for _ in range(3)]
    prompt = " ".join(map(str, ds)) + " ="
    answer = [(d + 1) % 10 for d in ds]
    p_right = rng.random()
    length = rng.choices([1, 2, 3, 4], weights=[1, 1, 5, 3])[0]
    got = [answer[i] if i < 3 and rng.random() < p_right else rng.randrange(10) for i in range(length)]
    words = [str(g) for g in got]
    if length == 4 and rng.random() < 0.5:
        words[-1] = rng.choice(["=", "<unk>", "<bos>", "<pad>"])
    right = sum(str(a) == w for a, w in zip(answer, words))
    return prompt, " ".join(words), 0.9 * right / 3 + 0.1 * (length == 3)


def digits_reward_model_dir(
    path: str, steps: int = 500, batch_size: int = 128, hidden_size: int = 64, seed: int = 0, overwrite: bool = False
) -> str:
    """Train the classifier to regress the digits reward from (prompt, completion) text; save it; return `path`.

    A few hundred Adam steps on CPU (tens of seconds): its score then tracks the task's reward,
    so a policy trained on it also gets better at the task.
    """
    if os.path.isfile(os.path.join(path, "config.json")) and not overwrite:
        return path
    from hybrid_rl.rewards.model import encode_texts, left_pad_batch, score_forward

    tok = build_reward_tokenizer()
    model = _build("classifier", tok, hidden_size, 2, 1, seed)
    model.config.pad_token_id = -1  # scored as rewards/model.py scores it: at the last (left-padded) position
    rng = random.Random(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
        model.train()
        for _ in range(steps):
            batch = [_digits_example(rng) for _ in range(batch_size)]
            ids = encode_texts(tok, [b[0] for b in batch], [b[1] for b in batch])
            ids_NL, attn_NL = left_pad_batch(ids, tok.pad_token_id, torch.device("cpu"))
            pred_N = score_forward(model, ids_NL, attn_NL, "classifier", 0)
            loss = torch.nn.functional.mse_loss(pred_N, torch.tensor([b[2] for b in batch]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    model.config.pad_token_id = tok.pad_token_id
    return _save(model, tok, path)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(
        prog="python -m hybrid_rl.rewards.tiny_model",
        description="Build the digits-task reward model for recipes/grpo_tiny.py.",
    )
    p.add_argument("path")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--random", action="store_true", help="an untrained (random) classifier instead")
    args = p.parse_args(argv)
    if args.random:
        random_reward_model_dir(args.path, overwrite=True)
    else:
        digits_reward_model_dir(args.path, steps=args.steps, overwrite=True)
    print(f"reward model saved to {args.path}")


if __name__ == "__main__":
    main(sys.argv[1:])
