"""The tiny multi-turn task: ask for a hidden digit, then answer it. Two turns are needed for full reward.

The prompt is the same for every row ("?"); each row hides a digit. Turn 1: a turn whose first
word is `ask` earns ASK_REWARD and the environment answers with the digit as a tool message; a
turn that does anything else ends the episode with nothing (a lucky guess earns no credit, so
one turn can never reach the full reward). Turn 2: a first word equal to the digit earns
ANSWER_REWARD. A random policy over the ~20-word vocabulary asks about 1 time in 20 (mean
reward ~0.01); a policy that asks and then copies the digit it was just shown earns 1.0, which a
2-layer model learns (the digit sits a few tokens back in its context).

The word-level tokenizer of models/tiny.py has no chat template, and observations are chat
messages, so this task's tokenizer carries a small one (CHAT_TEMPLATE): every turn is
`<role> content`, an assistant turn closes with `<eos>` (the stop token), and the generation
prompt is `<assistant>`. The conversation "? / ask / 7" renders as
`<user> ? <assistant> ask <eos> <tool> 7 <assistant>`.

    env.name=tiny_ask    rows: ask_rows(n, seed)    model: build_ask_model_dir(path)
"""
from __future__ import annotations

import os
import random

from hybrid_rl.envs.base import Step, register_env

ASK_REWARD, ANSWER_REWARD = 0.2, 0.8
ASK, PROMPT = "ask", "?"
WORDS = [str(d) for d in range(10)] + [ASK, PROMPT, "<system>", "<user>", "<assistant>", "<tool>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}{% if m['role'] == 'assistant' %} <eos>{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def ask_rows(n: int, seed: int) -> list[dict]:
    """`n` rows, each hiding a seeded random digit; the prompt is the same for all."""
    rng = random.Random(seed)
    return [{"prompt": PROMPT, "secret": str(rng.randrange(10))} for _ in range(n)]


def build_ask_tokenizer():
    """The word-level tokenizer of models/tiny.py over WORDS, with this task's chat template."""
    from hybrid_rl.models.tiny import build_word_tokenizer

    tok = build_word_tokenizer(WORDS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_ask_model_dir(path: str, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                        overwrite: bool = False) -> str:
    """A random-init tiny Qwen2 with the task's tokenizer, saved as a normal HF directory (atomically)."""
    from hybrid_rl.models.tiny import save_random_qwen2

    if os.path.isfile(os.path.join(path, "config.json")) and not overwrite:
        return path
    return save_random_qwen2(path, build_ask_tokenizer(), hidden_size, num_layers, 4, 2, 4 * hidden_size, 128, seed)


class AskEnv:
    """One episode: the row's hidden digit, and whether the model has asked for it yet."""

    def __init__(self, row: dict):
        self.secret, self.asked = str(row["secret"]), False

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, completion: str) -> Step:
        words = completion.split()
        first = words[0] if words else ""
        if not self.asked:
            if first != ASK:
                return Step([], 0.0, True)  # answered (or babbled) before asking: nothing earned, episode over
            self.asked = True
            return Step([{"role": "tool", "content": self.secret}], ASK_REWARD, False)
        return Step([], ANSWER_REWARD if first == self.secret else 0.0, True)


@register_env("tiny_ask")
def tiny_ask(row: dict) -> AskEnv:
    """One episode of the ask-then-answer task for `row`."""
    return AskEnv(row)
