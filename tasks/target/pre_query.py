"""The chat template up to where a user's words begin: what a synthesized source gives the target
so that it writes a user request itself (Magpie, arXiv 2406.08464).

The prefix is found by rendering a conversation whose user turn is a sentinel and cutting at the
sentinel, with two sentinels: a template that transforms the user's text (strips, escapes,
repeats it) or writes something that depends on it before it would give a prefix that is not the
template's, and is refused, naming the target, before anything is generated.
"""

from __future__ import annotations

from typing import Any

from tasks.target.model_dir import TargetError
from tasks.target.tokenizer import render_prompt_text

_SENTINELS = ("EAGLESCALE-USER-SENTINEL-7f3a", "EAGLESCALE-OTHER-SENTINEL-c41d")


def _prefix_for(tokenizer: Any, system_prompt: str | None, sentinel: str, target: str) -> str:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": sentinel}
    ]
    text = render_prompt_text(tokenizer, messages)
    found = text.count(sentinel)
    if found != 1:
        raise TargetError(
            f"the chat template of {target} writes a user turn's text {found} times, not once: the "
            "start of a user turn cannot be cut from it, so a synthesized source cannot use this "
            "target (set target.chat_template to a template that writes it once)"
        )
    return text[: text.index(sentinel)]


def pre_query_text(tokenizer: Any, system_prompt: str | None, target: str) -> str:
    """The template's text up to the first character of the user's turn (after `system_prompt`,
    when given); TargetError naming `target` when the template gives none."""
    first, second = (_prefix_for(tokenizer, system_prompt, s, target) for s in _SENTINELS)
    if first != second:
        raise TargetError(
            f"the chat template of {target} writes something before a user turn's text that "
            "depends on that text, so the start of a user turn is not fixed and a synthesized "
            "source cannot use this target"
        )
    if system_prompt and system_prompt not in first:
        raise TargetError(
            f"the chat template of {target} drops the system turn before the user turn: a "
            "synthesized source's system_prompt would steer nothing; remove it, or use a template "
            "that writes system turns"
        )
    if not first.strip():
        raise TargetError(
            f"the chat template of {target} writes nothing before a user turn's text: there is no "
            "start of a turn to write a request from"
        )
    return first


def pre_query_ids(tokenizer: Any, system_prompt: str | None, seed_text: str | None, target: str) -> list[int]:
    """The ids a synthesized request is written from: the pre-query text and the seed text,
    encoded as the generation stage encodes a rendered prompt (no added special tokens: the
    template writes its own)."""
    text = pre_query_text(tokenizer, system_prompt, target) + (seed_text or "")
    return [int(i) for i in tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]]
