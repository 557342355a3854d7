"""Observation token ids as a chat-template DELTA after a generated turn, without touching earlier tokens.

An episode's tokens are the prompt, each turn exactly as the engine sampled it, and each
observation's ids. Re-rendering the whole conversation each turn and re-tokenizing it would
change earlier tokens (the model's text tokenized afresh is not always what it sampled, and
some templates rewrite earlier turns), so the trainer would score tokens that were never
sampled. Instead the observation's ids are the text the template adds AFTER the turn's
end-of-turn token when the new messages follow it:

    head = render(history without the last assistant turn, generation prompt)   # where the turn began
    base = render(history)                     # ... assistant turn ... <end> tail
    full = render(history + new, generation prompt)
    cut  = just after the assistant turn's <end> in `full`;  delta = full[cut:]

`head` must be a prefix of `full` (else the template rewrites turns before this one: an error).
When `full` starts with `base` up to its last <end>, the cut is there. Templates that render the
last assistant turn differently once it is no longer last (Qwen3 drops earlier turns' reasoning)
are handled by finding that turn's <end> by count instead of by position. The delta is then
checked to tokenize the same alone as inside `full`, so the ids appended are the ones the
template and tokenizer would give at that point. A turn cut before its <end> (max_new_tokens)
gets the <end> as the first observation token (never trained: it was not sampled).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


class ChatDeltaError(ValueError):
    """The chat template or tokenizer cannot append an observation without changing earlier tokens."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer: Any, what: str = "the environment's observations") -> None:
    """Raise before any episode runs when messages would need a template the tokenizer does not have."""
    if not has_chat_template(tokenizer):
        raise ChatDeltaError(
            f"{what} are chat messages, but the tokenizer has no chat template to render them; "
            "use a tokenizer with one (set tokenizer.chat_template) or an environment for raw text"
        )


def render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text that already holds every special token it needs (the template wrote them)."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def prompt_ids(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """The opening conversation rendered with the generation prompt, encoded once (the episode's prompt)."""
    require_chat_template(tokenizer)
    return encode(tokenizer, render(tokenizer, messages, True))


def end_of_turn_text(tokenizer: Any, end_text: Optional[str] = None) -> str:
    """The text the template closes an assistant turn with: `end_text`, else the tokenizer's EOS."""
    text = end_text if end_text is not None else getattr(tokenizer, "eos_token", None)
    if not text:
        raise ChatDeltaError("the tokenizer has no eos_token to find the end of an assistant turn by; pass end_text")
    return text


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _cut_after_turn(head: str, base: str, full: str, end: str) -> int:
    """The index in `full` just after the last assistant turn's end-of-turn text."""
    if not full.startswith(head) or not base.startswith(head):
        at = _first_difference(head, full if not full.startswith(head) else base)
        raise ChatDeltaError(
            "the chat template renders turns before the latest assistant turn differently once "
            f"more messages follow (first difference at character {at}: "
            f"{head[max(0, at - 30) : at + 30]!r}); no observation can be appended without changing "
            "earlier tokens. Use a template that only appends"
        )
    last = base.rfind(end)
    if last < len(head):
        raise ChatDeltaError(
            f"the chat template does not close an assistant turn with {end!r} (the end-of-turn "
            "text); pass the text it does close turns with as end_text"
        )
    cut = last + len(end)
    if full.startswith(base[:cut]):
        return cut
    # The template re-renders the last assistant turn once it is followed by more messages: find its
    # end by how many end-of-turn texts precede it, which a rewrite of the turn's content does not change.
    k = base.count(end, 0, cut)
    at = -len(end)
    for _ in range(k):
        at = full.find(end, at + len(end))
        if at < 0:
            break
    if at < len(head):
        raise ChatDeltaError(
            "the chat template renders the latest assistant turn differently once more "
            f"messages follow and its end {end!r} cannot be found; cannot place the observation"
        )
    return at + len(end)


def observation_ids(
    tokenizer: Any,
    history: Sequence[dict],
    new: Sequence[dict],
    turn_closed: bool = True,
    end_text: Optional[str] = None,
) -> list[int]:
    """Token ids to append after a generated turn so the sequence continues as the template would.

    history: the conversation so far, ending with the assistant turn just generated (its text).
    new: the messages the environment returned (may be empty: then only the next generation prompt).
    turn_closed: the generated ids end with the end-of-turn token; if not, the delta starts with it.
    """
    require_chat_template(tokenizer)
    if not history or history[-1].get("role") != "assistant":
        raise ValueError("history must end with the assistant turn the observation follows")
    end = end_of_turn_text(tokenizer, end_text)
    head = render(tokenizer, history[:-1], True)
    base = render(tokenizer, history, False)
    full = render(tokenizer, [*history, *new], True)
    cut = _cut_after_turn(head, base, full, end)
    start = cut if turn_closed else cut - len(end)
    delta = full[start:]
    ids = encode(tokenizer, delta)
    whole, before = encode(tokenizer, full), encode(tokenizer, full[:start])
    if whole != before + ids:
        raise ChatDeltaError(
            f"the tokenizer joins text across the end of the assistant turn "
            f"({full[start : start + 40]!r} "
            "tokenizes differently alone than after the turn), so the observation's ids would not be "
            "the template's; end assistant turns with a special token"
        )
    return ids
