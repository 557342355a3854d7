"""The tiny multi-turn task: ask for a hidden digit, then answer it. Two turns are needed for full reward.

The prompt is the same for every row ("?"); each row hides a digit. Turn 1: if its first word is
`ask`, the environment answers with the digit as a tool message; a turn that does anything else
ends the episode with nothing (a lucky guess earns no credit, so one turn never earns anything).
Turn 2: a first word that is a digit earns ASK_REWARD (asked, then answered), and ANSWER_REWARD
more if it is the hidden one. The ask credit is paid in turn 2, not turn 1, on purpose: paid for
asking alone, the policy learns "after <assistant>, say ask" in BOTH turns, every episode of a
group then earns the same, and the answer turn gets no signal (seen in a bare GRPO loop). A
random policy over the ~20-word vocabulary earns ~0.005 on average; a policy that asks and then
copies the digit it was just shown (a few tokens back in its context) earns 1.0.

Hidden digits are drawn from SECRET_DIGITS (4) values, not 10: GRPO sees the copy only through the
group's samples that happen to name the hidden digit, 1 in 10 of a random answer, and at 10 the tiny
model settled on one fixed digit (last-10% reward ~0.27 = asking plus chance). At 4, one in four is
right by chance and the copy is learned: with turns of one word (rollout.max_new_tokens=1), 64 rows x
8 episodes a step and lr 3e-3, the reward passes 0.9 after ~45 steps and stays ~1.0
(tests/recipes/test_tiny_ask.py).

The word-level tokenizer of models/tiny.py has no chat template, and observations are chat
messages, so this task's tokenizer carries a small one (CHAT_TEMPLATE): every turn is
`<role>content`, an assistant turn closes with `<eos>` (the stop token), and the generation
prompt is `<assistant>`. The conversation "? / ask / 7" renders as
`<user>?<assistant>ask<eos><tool>7<assistant>`, 8 tokens. Every word is also an ADDED token and
the template puts no spaces between them: transformers 5 loads a saved Qwen2-type directory with
its byte-level Qwen2Tokenizer, which would drop multi-character words such as `ask` and `<user>`
from plain text; added tokens are matched before any pre-tokenizer, so the ids are the same
whichever class loads it. (It decodes `ask 7` as "ask7", hence the parsing in `_first_word`.)

    env.name=tiny_ask    rows: ask_rows(n, seed)    model: build_ask_model_dir(path)
"""

from __future__ import annotations

import os
import random
import re

from hybrid_rl.envs.base import Step, register_env

ASK_REWARD, ANSWER_REWARD = 0.2, 0.8
SECRET_DIGITS = 4  # hidden digits are 0..3 (module docstring)
ASK, PROMPT = "ask", "?"
WORDS = [str(d) for d in range(10)] + [ASK, PROMPT, "<system>", "<user>", "<assistant>", "<tool>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
_FIRST_RE = re.compile(r"\s*(ask|\d)")


def ask_rows(n: int, seed: int, digits: int = SECRET_DIGITS) -> list[dict]:
    """`n` rows, each hiding a seeded random digit below `digits`; the prompt is the same for all."""
    if not 1 <= digits <= 10:
        raise ValueError(f"digits must be in 1..10, got {digits}")
    rng = random.Random(seed)
    return [{"prompt": PROMPT, "secret": str(rng.randrange(digits))} for _ in range(n)]


def build_ask_tokenizer():
    """The word-level tokenizer of models/tiny.py over WORDS, with this task's chat template."""
    from hybrid_rl.models.tiny import build_word_tokenizer

    tok = build_word_tokenizer(WORDS)
    tok.backend_tokenizer.add_tokens(WORDS)  # same ids under any pre-tokenizer (module docstring)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_ask_model_dir(
    path: str, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, overwrite: bool = False
) -> str:
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
        first = _first_word(completion)
        if not self.asked:
            if first != ASK:
                return Step([], 0.0, True)  # answered (or babbled) before asking: nothing earned, episode over
            self.asked = True
            return Step([{"role": "tool", "content": self.secret}], 0.0, False)
        if not first.isdigit():
            return Step([], 0.0, True)  # asked, then did not answer with a digit
        return Step([], ASK_REWARD + (ANSWER_REWARD if first == self.secret else 0.0), True)


def _first_word(text: str) -> str:
    """`ask` or the digit the turn starts with ("" if neither), with or without spaces between words."""
    m = _FIRST_RE.match(text)
    return m.group(1) if m else ""


@register_env("tiny_ask")
def tiny_ask(row: dict) -> AskEnv:
    """One episode of the ask-then-answer task for `row`."""
    return AskEnv(row)
