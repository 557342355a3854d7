"""Prompt text -> token ids: the tokenizer's chat template (when used), each prompt encoded once,
and prompts over `data.max_prompt_tokens`, or too long for the model's context with the answer, dropped
and counted (never truncated).
"""

from __future__ import annotations

import difflib
import json
import unicodedata
from typing import Optional, Sequence

from hybrid_rl.data.rows import DataError


def use_chat_template(tokenizer, setting: Optional[bool], model_path: str) -> bool:
    """`data.chat_template`: null = when the tokenizer has one, true = it must, false = never."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting is True and not has:
        raise ValueError(
            f"config key 'data.chat_template': true, but the tokenizer in {model_path!r} has no chat "
            "template; set data.chat_template=false (raw prompts) or null (a template when there is one)"
        )
    return has if setting is None else setting


class PromptEncoder:
    """Token ids of a row's prompt, chat template applied when configured; each distinct prompt is encoded once.

    A row's prompt is its text (`row["prompt"]`), or a conversation (`row["messages"]`: chat messages
    ending in a user turn, the TRL / verl conversational format; data/prompts.py checks them).
    `system_prompt` (data.system_prompt) opens every conversation that has no system turn of its own.
    """

    def __init__(self, tokenizer, chat_template: bool, model_path: str = "", system_prompt: str = ""):
        if system_prompt and not chat_template:
            raise ValueError(
                "config key 'data.system_prompt' needs a chat template to place it in: set "
                "data.chat_template=null or true with a tokenizer that has one, or drop the system prompt"
            )
        self.tokenizer, self.chat_template, self.model_path = tokenizer, chat_template, model_path
        self.system_prompt = system_prompt
        self._ids: dict[str, list[int]] = {}

    @staticmethod
    def _row(row: dict | str) -> dict:
        """A prompt text as the row that holds it; a row as it is."""
        return row if isinstance(row, dict) else {"prompt": row}

    def conversation(self, row: dict | str) -> list[dict]:
        """The chat messages the template renders for `row` (a row dict, or a prompt text)."""
        row = self._row(row)
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def render(self, row: dict | str) -> str:
        """The text the model sees: the conversation plus the assistant header, or the prompt itself."""
        row = self._row(row)
        if self.chat_template:
            return self.tokenizer.apply_chat_template(
                self.conversation(row), tokenize=False, add_generation_prompt=True
            )
        if row.get("messages") is not None:
            raise DataError(
                "a row holds chat messages but data.chat_template=false: messages need the "
                "tokenizer's chat template (data.chat_template=null or true)"
            )
        return row["prompt"]

    def _key(self, row: dict | str) -> str:
        row = self._row(row)
        messages = row.get("messages")
        return row["prompt"] if messages is None else json.dumps(messages, sort_keys=True)

    def __call__(self, row: dict | str) -> list[int]:
        """Token ids of a row (or of a prompt text)."""
        key = self._key(row)
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = self.tokenizer(self.render(row), add_special_tokens=False).input_ids
        return ids

    def encode_all(self, rows: Sequence[dict], source: str, check: bool = True) -> list[int]:
        """Encode every row's prompt in one tokenizer call; returns the lengths. A template that fails names the row;
        so does a prompt the tokenizer cannot encode (`check`: off where an environment builds the prompts)."""
        todo: dict[str, int] = {}
        for i, r in enumerate(rows):
            key = self._key(r)
            if key not in self._ids and key not in todo:
                todo[key] = i
        texts = []
        for key, i in todo.items():
            try:
                texts.append(self.render(rows[i]))
            except Exception as err:  # jinja errors and whatever else a template raises
                raise DataError(
                    f"the prompt of {source} row {i} cannot be rendered ({type(err).__name__}: {err}); "
                    f"fix the row or the chat template of the tokenizer in {self.model_path!r}, or set "
                    "data.chat_template=false (plain-text prompts only)"
                ) from err
        if texts:
            encoded = self.tokenizer(texts, add_special_tokens=False).input_ids
            decoded = self.tokenizer.batch_decode(encoded, skip_special_tokens=False) if check else texts
            for (key, i), text, ids, back in zip(todo.items(), texts, encoded, decoded):
                if check:
                    self._check_encodable(text, ids, back, f"{source} row {i}")
                self._ids[key] = ids
        return [len(self._ids[self._key(r)]) for r in rows]

    def _check_encodable(self, text: str, ids: list[int], back: str, where: str) -> None:
        """Refuse a prompt the tokenizer cannot represent: text that does not come back when its tokens are
        decoded (a word-level vocabulary such as the tiny models' drops unknown words or maps them to its unknown
        token), or no token at all. The model would otherwise train on a prompt other than the row's. Whitespace
        and Unicode compatibility forms are the tokenizer's to normalise: they are compared away."""
        lost = _lost_text(text, back)
        if ids and not lost:
            return
        if not ids:
            what = "it encodes to no token at all"
        else:
            shown = ", ".join(repr(p) for p in lost[:5]) + (", ..." if len(lost) > 5 else "")
            what = f"its vocabulary has no token for {shown}"
        raise DataError(
            f"the prompt of {where} cannot be encoded by the tokenizer of {self.model_path!r}: {what}; prompt: "
            f"{text[:80]!r}. Use a model whose tokenizer covers the data (the tiny digits model knows only the "
            "digits 0-9 and '=': README, Supported models), or fix the row"
        )


def _lost_text(text: str, back: str) -> list[str]:
    """The pieces of `text` missing from `back` (its tokens decoded), whitespace and NFKC forms aside; each as it
    reads in `text` (spaces inside a piece kept)."""

    def squeeze(x: str) -> str:
        return "".join(unicodedata.normalize("NFKC", x).split())

    if squeeze(text) == squeeze(back):
        return []
    # Each kept character with the index of the character of `text` it came from (NFKC may expand one into two).
    chars = [(n, i) for i, c in enumerate(text) for n in unicodedata.normalize("NFKC", c) if not n.isspace()]
    a = "".join(n for n, _ in chars)
    ops = difflib.SequenceMatcher(None, a, squeeze(back), autojunk=False).get_opcodes()
    pieces = [text[chars[i1][1] : chars[i2 - 1][1] + 1] for op, i1, i2, _, _ in ops if op in ("delete", "replace")]
    return list(dict.fromkeys(p for p in pieces if p)) or ["(text its tokens decode differently)"]


def drop_long_prompts(rows: list[dict], lengths: Sequence[int], max_tokens: int) -> tuple[list[dict], int]:
    """(rows of at most `max_tokens` prompt tokens, how many were dropped); 0 keeps all."""
    if max_tokens <= 0:
        return rows, 0
    kept = [r for r, n in zip(rows, lengths) if n <= max_tokens]
    return kept, len(rows) - len(kept)


def prompt_limit(max_prompt_tokens: int, max_new_tokens: int, context: Optional[int]) -> tuple[int, str, str]:
    """(longest prompt kept, in tokens, 0 = any; what sets it; what to change if no prompt fits):
    data.max_prompt_tokens, or less where a prompt and rollout.max_new_tokens would not fit the
    model's context (max_position_embeddings; None = unknown). SGLang rejects such a request, and
    the whole batch with it (input + max_new_tokens >= context length); the native engine would
    decode at positions the model never saw."""
    limit, T = max_prompt_tokens, max_new_tokens
    by_config = (limit, f"data.max_prompt_tokens={limit}", "raise data.max_prompt_tokens")
    if not context:
        return by_config
    fit = context - T - 1
    if fit < 1:
        raise ValueError(
            f"rollout.max_new_tokens={T} leaves no room for a prompt in the model's context of "
            f"{context} tokens (max_position_embeddings): lower rollout.max_new_tokens"
        )
    if limit and limit <= fit:
        return by_config
    return (
        fit,
        f"{fit} tokens (the model's context of {context} less rollout.max_new_tokens={T} and one)",
        "lower rollout.max_new_tokens",
    )
