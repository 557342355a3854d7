"""Prompt text -> token ids: the tokenizer's chat template (when used), each prompt encoded once,
and prompts over `data.max_prompt_tokens`, or too long for the model's context with the answer, dropped
and counted (never truncated).
"""
from __future__ import annotations

from typing import Optional, Sequence


def use_chat_template(tokenizer, setting: Optional[bool], model_path: str) -> bool:
    """`data.chat_template`: null = when the tokenizer has one, true = it must, false = never."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting is True and not has:
        raise ValueError(f"config key 'data.chat_template': true, but the tokenizer in {model_path!r} has no chat "
                         "template; set data.chat_template=false (raw prompts) or null (a template when there is one)")
    return has if setting is None else setting


class PromptEncoder:
    """Token ids of a prompt, chat template applied when configured; each distinct prompt is encoded once."""

    def __init__(self, tokenizer, chat_template: bool, model_path: str = ""):
        self.tokenizer, self.chat_template, self.model_path = tokenizer, chat_template, model_path
        self._ids: dict[str, list[int]] = {}

    def render(self, prompt: str) -> str:
        """The text the model sees: the prompt as a user turn plus the assistant header, or the prompt itself."""
        if not self.chat_template:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    def __call__(self, prompt: str) -> list[int]:
        ids = self._ids.get(prompt)
        if ids is None:
            ids = self._ids[prompt] = self.tokenizer(self.render(prompt), add_special_tokens=False).input_ids
        return ids

    def encode_all(self, rows: Sequence[dict], source: str) -> list[int]:
        """Encode every row's prompt in one tokenizer call; returns the lengths. A template that fails names the row."""
        todo = [r["prompt"] for r in rows if r["prompt"] not in self._ids]
        texts = []
        for prompt in todo:
            try:
                texts.append(self.render(prompt))
            except Exception as err:  # jinja errors and whatever else a template raises
                i = next(k for k, r in enumerate(rows) if r["prompt"] == prompt)
                raise ValueError(f"the chat template of the tokenizer in {self.model_path!r} failed on {source} row "
                                 f"{i} ({type(err).__name__}: {err}); fix the template or set "
                                 "data.chat_template=false") from err
        if texts:
            for prompt, ids in zip(todo, self.tokenizer(texts, add_special_tokens=False).input_ids):
                self._ids[prompt] = ids
        return [len(self._ids[r["prompt"]]) for r in rows]


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
        raise ValueError(f"rollout.max_new_tokens={T} leaves no room for a prompt in the model's context of "
                         f"{context} tokens (max_position_embeddings): lower rollout.max_new_tokens")
    if limit and limit <= fit:
        return by_config
    return (fit, f"{fit} tokens (the model's context of {context} less rollout.max_new_tokens={T} and one)",
            "lower rollout.max_new_tokens")
