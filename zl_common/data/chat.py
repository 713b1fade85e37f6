"""Chat data: JSONL rows ``{"messages": [{"role", "content"}, ...]}`` rendered with the tokenizer's
own chat template, the loss on every assistant turn's tokens only.

Rendering: the whole conversation is rendered once (``apply_chat_template``, the text the model
will see at inference); each assistant turn's characters are found by rendering the conversation
up to that turn with ``add_generation_prompt=True`` and up to its end: the difference is the
turn's answer (its content and the template's end-of-turn token, nothing after that token). The
tokens whose characters start inside an answer are the targets. A template whose rendering of a
prefix is not a prefix of the whole (one that rewrites earlier turns) is refused, not guessed at.

A tokenizer with no template (the built-in tiny model's) gets ``FALLBACK_CHAT_TEMPLATE``:
``<bos>role : content\\n`` per turn, every assistant turn closed by ``<eos>``; the generation
prompt is ``assistant :``.

Rows longer than seq-len are cut at the end (the start of a conversation, its system turn and
first question, is what the later turns depend on); answer tokens past the cut are lost and
counted; a row with no answer token left is skipped and counted (``EncodedList``).
"""
from __future__ import annotations

import json

ROLES = ("system", "user", "assistant")

# The fallback for a tokenizer without a chat template: plain "role : content" lines, which the tiny
# model's word-level tokenizer splits into words; eos closes each assistant turn so generation stops.
# (The newline is an expression: transformers renders with trim_blocks, which eats one after a tag.)
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}")


def check_messages(obj) -> str:
    """'' for a well-formed chat row, else the problem in a few words."""
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return '"messages" is not a non-empty list'
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f'message {k} is not an object with "role" and "content"'
        if m["role"] not in ROLES:
            return f"message {k} has unknown role {m['role']!r} (expected one of {', '.join(ROLES)})"
        if not isinstance(m["content"], str):
            return f"message {k}'s content is not a string"
        if m["role"] == "assistant" and not m["content"].strip():
            return f"message {k} is an empty assistant turn"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no assistant turn (nothing to train on)"
    return ""


def template_of(tokenizer) -> str:
    """The tokenizer's chat template, or the documented fallback."""
    return getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE


def _render(tokenizer, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template_of(tokenizer), tokenize=False,
                                         add_generation_prompt=generation_prompt)


def render_chat(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, [start, end) character spans of every assistant answer)."""
    from .examples import DataError

    text = _render(tokenizer, messages, False)
    eos = getattr(tokenizer, "eos_token", None)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else _render(tokenizer, [], True)
        upto = _render(tokenizer, messages[:i + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DataError("the tokenizer's chat template renders a conversation's start differently from the "
                            "whole conversation, so the assistant turns cannot be located; use a template that "
                            "appends turns (or set tokenizer.chat_template)")
        start, end = len(before), len(upto)
        if eos and (k := upto.rfind(eos, start)) >= 0:
            end = k + len(eos)  # the end-of-turn token is an answer token, what follows it is not
        spans.append((start, end))
    return text, spans


def chat_ids(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is an assistant token."""
    text, spans = render_chat(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    is_answer = [any(s <= a < e for s, e in spans) and b > a for a, b in enc["offset_mapping"]]
    return ids, is_answer


def generation_prompt(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """(the text up to the last assistant turn, with the generation prompt; that turn's content):
    what eval asks the model and the answer it is compared with."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return _render(tokenizer, messages[:last], True), messages[last]["content"]


def read_messages_row(line: str) -> dict | str:
    """A JSONL line parsed as a chat row, or the problem as text (for the loader's one-line error)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict) or "messages" not in obj:
        return 'not a {"messages": [...]} object (a chat file has chat rows only)'
    return check_messages(obj) or {"messages": obj["messages"]}
