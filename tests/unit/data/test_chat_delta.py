"""data/chat_delta.py: observation ids appended after a generated turn leave every earlier token as it was.

The strongest check: build a conversation turn by turn the way the episode runner does (prompt ids,
then each turn's ids + the stop token, then the delta) and compare with the whole conversation
rendered and tokenized at once. For templates that only append, the two must be identical; any
slip in where the delta starts (a lost newline, a doubled end-of-turn token) shows up as a
difference. Templates: the tiny ask task's, tiny_text's ChatML, and a Qwen2.5-style one carried
as a fixture file (tests/fixtures/qwen25_chat_template.jinja), plus hand-made bad ones.
"""

from __future__ import annotations

import copy
import os

import pytest

from hybrid_rl.data.chat_delta import ChatDeltaError, encode, observation_ids, prompt_ids, render

FIXTURE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "fixtures", "qwen25_chat_template.jinja"
)


def _text_tokenizer(template: str | None = None):
    from hybrid_rl.models.tiny_text import build_text_tokenizer

    tok = build_text_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def qwen25():
    with open(FIXTURE) as f:
        return _text_tokenizer(f.read())


@pytest.fixture(scope="module")
def chatml():
    return _text_tokenizer()


@pytest.fixture(scope="module")
def ask_tok():
    from hybrid_rl.envs.tiny_ask import build_ask_tokenizer

    return build_ask_tokenizer()


def _assemble(tok, opening, turns):
    """Episode ids built as the runner builds them: turns are (assistant text, observation messages)."""
    messages = list(opening)
    ids = prompt_ids(tok, messages)
    for text, observation in turns:
        ids += encode(tok, text) + [tok.eos_token_id]  # the sampled turn, stop token included
        messages.append({"role": "assistant", "content": text})
        ids += observation_ids(tok, messages, observation)
        messages += observation
    return ids, messages


TOOL_TURNS = [
    (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>',
        [{"role": "tool", "content": "12"}],
    ),
    ("Two more calls.", [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]),
    ("Now the user speaks.", [{"role": "user", "content": "And then?"}]),
]


@pytest.mark.parametrize("name", ["qwen25", "chatml"])
def test_turn_by_turn_equals_the_whole_conversation(name, request):
    tok = request.getfixturevalue(name)
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3*4?"}]
    ids, messages = _assemble(tok, opening, TOOL_TURNS)
    assert ids == encode(tok, render(tok, messages, True))


def test_qwen25_default_system_turn_and_grouped_tool_results(qwen25):
    ids, messages = _assemble(qwen25, [{"role": "user", "content": "hi"}], TOOL_TURNS[1:2])
    text = qwen25.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    # two tool results in ONE user turn, then the generation prompt
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == encode(qwen25, render(qwen25, messages, True))


def test_tiny_ask_template(ask_tok):
    turns = [("ask", [{"role": "tool", "content": "7"}])]
    ids, messages = _assemble(ask_tok, [{"role": "user", "content": "?"}], turns)
    words = ask_tok.convert_ids_to_tokens(ids)
    assert words == ["<user>", "?", "<assistant>", "ask", "<eos>", "<tool>", "7", "<assistant>"]
    assert ids == encode(ask_tok, render(ask_tok, messages, True))


def test_delta_never_changes_the_prefix_of_the_sampled_ids(qwen25):
    """Sampled ids that are NOT the canonical tokenization of their text stay exactly as they were."""
    opening = [{"role": "user", "content": "x"}]
    prefix = prompt_ids(qwen25, opening)
    hashes = qwen25.convert_tokens_to_ids(["#", "#", "#", "#"])  # `####` sampled as four tokens, not one
    sampled = hashes + [qwen25.eos_token_id]
    messages = opening + [{"role": "assistant", "content": qwen25.decode(hashes)}]
    delta = observation_ids(qwen25, messages, [{"role": "tool", "content": "1"}])
    episode = prefix + sampled + delta
    assert episode[: len(prefix) + len(sampled)] == prefix + sampled
    assert encode(qwen25, "####") != hashes  # the case is real: re-encoding would have changed them


def test_empty_observation_is_just_the_next_generation_prompt(chatml):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert chatml.decode(observation_ids(chatml, messages, [])) == "\n<|im_start|>assistant\n"


def test_a_turn_cut_before_its_end_gets_the_end_token_as_observation(chatml):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc"}]
    closed = observation_ids(chatml, messages, [{"role": "tool", "content": "r"}], turn_closed=True)
    cut = observation_ids(chatml, messages, [{"role": "tool", "content": "r"}], turn_closed=False)
    assert cut == [chatml.eos_token_id] + closed


THINK_STRIPPING = (  # Qwen3-like: an assistant turn that is no longer last loses its reasoning
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_that_rerenders_the_last_assistant_turn_is_handled():
    tok = _text_tokenizer(THINK_STRIPPING)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think>42"}]
    delta = observation_ids(tok, messages, [{"role": "user", "content": "sure?"}])
    assert tok.decode(delta) == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"


def test_template_that_rewrites_earlier_turns_is_an_error():
    counting = (
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>{% endif %}"
    )
    tok = _text_tokenizer(counting)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ChatDeltaError, match="differently once more messages follow"):
        observation_ids(tok, messages, [{"role": "tool", "content": "r"}])


def test_tokens_merging_across_the_turn_end_is_an_error():
    # turns close with a plain '#', tool turns open with '#': '##' is one token of this tokenizer
    merging = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}>{% endif %}{{ m['content'] }}#{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    tok = _text_tokenizer(merging)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ChatDeltaError, match="tokenizes differently"):
        observation_ids(tok, messages, [{"role": "tool", "content": "#r"}], end_text="#")


def test_no_chat_template_is_an_error():
    from hybrid_rl.models.tiny import build_word_tokenizer

    tok = build_word_tokenizer(["a"])
    with pytest.raises(ChatDeltaError, match="no chat template"):
        prompt_ids(tok, [{"role": "user", "content": "a"}])


def test_end_text_not_in_template_is_an_error(chatml):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ChatDeltaError, match="does not close an assistant turn"):
        observation_ids(chatml, messages, [], end_text="</s>")


def test_history_is_not_mutated(qwen25):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = copy.deepcopy(messages)
    observation_ids(qwen25, messages, [{"role": "tool", "content": "r"}])
    assert messages == before
