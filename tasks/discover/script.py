"""Which script a prompt is written in: the fraction of its letters that are Latin script.

The filter exists for English-only targets (SmolLM2): regenerating a Korean or Chinese chat
with them yields answers in the wrong language, or noise, and trains the draft on it. Only
letters count (digits, punctuation, symbols, emoji and code operators say nothing about the
language), and "Latin script" is what Unicode names say: every letter whose character name
contains LATIN (a-z, accented letters, ligatures, fullwidth Latin).
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

from tasks.discover.formats import Messages

_ASCII_LETTER = re.compile(r"[A-Za-z]")
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
_NOT_ASCII_LETTER = bytes(b for b in range(128) if not chr(b).isalpha())


@lru_cache(maxsize=65536)
def _letter_kind(ch: str) -> int:
    """0: not a letter, 1: a Latin letter, 2: a letter of another script."""
    if not ch.isalpha():
        return 0
    return 1 if "LATIN" in unicodedata.name(ch, "") else 2


def latin_fraction(messages: Messages) -> float | None:
    """Latin letters / all letters over every turn's text; None when there is no letter."""
    text = "".join(m["content"] for m in messages)
    if text.isascii():  # the common case, without a per-character loop
        return 1.0 if _ASCII_LETTER.search(text) else None
    # ASCII letters are counted in C; only the non-ASCII characters are looked at one by one.
    latin = len(text.encode("ascii", "ignore").translate(None, _NOT_ASCII_LETTER))
    other = 0
    for run in _NON_ASCII.findall(text):
        for ch in run:
            kind = _letter_kind(ch)
            if kind == 1:
                latin += 1
            elif kind == 2:
                other += 1
    letters = latin + other
    return latin / letters if letters else None
