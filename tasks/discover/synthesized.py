"""A synthesized source's rows as discovery reads them: one per slot the target wrote a request
for, and the checks a request passes before it is a prompt at all.

The synthesis itself (tasks/synthesize/) runs before discovery, through the generation stage's
shards; what it committed comes here as `SynthesizedRequest`s, one per slot, dead letters
included, so every slot lands in one table of prompts/. A request is dropped, with its reason, as

- `empty`: no text at all (the target ended the turn at once);
- `truncated`: it reached the source's `max_request_tokens` (finish reason "length");
- `non_text`: it holds template tokens (it wrote past its own turn), undecodable bytes (U+FFFD),
  control characters, or no letter or digit;
- `refusal`: it reads like an assistant's refusal, not a user's request (REFUSAL_PHRASES).

What passes becomes a prompt like any other source's: the source's system prompt (unless
`system_turns: drop`) and a user turn of its seed text and the request, filtered from there on
as every source is, and then for near-copies (near_duplicates.py).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.config import SourceConfig
from tasks.discover.formats import Messages

# An aligned chat model given only the start of a user turn sometimes answers as the assistant it
# was trained to be instead of writing a request (Magpie, arXiv 2406.08464, filters these). A
# request that opens with, or holds, one of these is an assistant's voice. Lower-case; matched on
# the casefolded text with typographic apostrophes made plain.
REFUSAL_PHRASES = (
    "i'm sorry, but",
    "i am sorry, but",
    "i'm sorry, i can't",
    "i can't assist",
    "i cannot assist",
    "i can't help with",
    "i cannot help with",
    "i'm unable to",
    "i am unable to",
    "i cannot fulfill",
    "i can't fulfill",
    "as an ai language model",
    "as an ai assistant",
    "i'm not able to provide",
    "i apologize, but",
    "i must decline",
)
# Characters no typed request holds: C0/C1 controls other than tab, newline and carriage return.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_WORD_CHAR = re.compile(r"[^\W_]")  # a letter or digit of any script


@dataclass(frozen=True)
class SynthesizedRequest:
    """One slot's outcome, as the synthesis committed it."""

    index: int  # the slot: 0..count-1, its row in the discovery funnel
    request_id: str
    text: str | None = None  # what the target wrote (seed text not included); None: dead letter
    finish_reason: str | None = None  # "stop" | "length"
    completion_tokens: int = 0
    special_tokens: int = 0  # template tokens inside the request, its final stop token aside
    error: str | None = None  # a dead letter's class and message


@dataclass(frozen=True)
class SynthesizedSet:
    """What the synthesis gives discovery: each synthesized source's slots, and its summary
    (requests, tokens, tokens per second) for the report."""

    requests: Mapping[str, Sequence[SynthesizedRequest]]
    summary: dict[str, Any] = field(default_factory=dict)


def refusal_phrase(text: str) -> str | None:
    """The first refusal phrase `text` holds, or None."""
    folded = unicodedata.normalize("NFKC", text).casefold().replace("\u2019", "'")
    return next((p for p in REFUSAL_PHRASES if p in folded), None)


def non_text_problem(text: str, special_tokens: int) -> str | None:
    if special_tokens:
        return f"holds {special_tokens} template token(s): the target wrote past its own turn"
    if "\ufffd" in text:
        return "holds undecodable bytes (U+FFFD)"
    if _CONTROL.search(text):
        return "holds control characters"
    if not _WORD_CHAR.search(text):
        return "holds no letter or digit"
    return None


def request_problem(src: SourceConfig, r: SynthesizedRequest) -> tuple[str, str] | None:
    """(reason, detail) for a request that cannot be a prompt, checked in the funnel's order;
    None for one that can. Dead letters are the caller's (quarantined)."""
    text = r.text or ""
    if not text.strip() or r.completion_tokens == 0:
        return "empty", f"slot {r.index}: the target wrote no request ({r.completion_tokens} tokens)"
    if r.finish_reason == "length":
        return "truncated", f"slot {r.index}: cut at max_request_tokens {src.max_request_tokens}"
    problem = non_text_problem(text, r.special_tokens)
    if problem is not None:
        return "non_text", f"slot {r.index}: {problem}"
    phrase = refusal_phrase(text)
    if phrase is not None:
        return "refusal", f"slot {r.index}: reads as a refusal ({phrase!r})"
    return None


def request_messages(src: SourceConfig, r: SynthesizedRequest) -> Messages:
    """The prompt a request gives: the steering system turn (unless system_turns: drop) and the
    user turn, the seed text and what the target wrote after it."""
    user = (src.seed_text or "") + (r.text or "")
    system = [] if src.system_turns == "drop" or not src.system_prompt else [
        {"role": "system", "content": src.system_prompt}
    ]
    return [*system, {"role": "user", "content": user.strip()}]
