"""Figures as people read them: the one formatter for every number a person reads (Slack, the
Prefect UI's artifacts and log lines, report.md, `eaglescale status`).

3-4 significant digits, thousands separators, CIs as `[0.685, 1.38]`, sizes and durations in
units, and never a Python repr (`None`, `{}`, `[0.6851852549722078, ...]`). Machine files
(report.json, progress.json, ...) keep full precision: only what is shown goes through here.
It imports nothing of eaglescale, so every layer may use it (tests/test_layering.py).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

DASH = "—"
SIZE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")
# Keys whose figures are a share of 1 (shown as a percentage), bytes, or seconds.
FRACTION_WORDS = ("_fraction", "_rate", "_share", "spread", "agreement")
NOT_FRACTIONS = ("learning_rate", "per_s")
MAX_TABLE_COLUMNS = 6  # wider markdown tables are split (the UI cuts them at its right edge)


def number(x: float | int | None, digits: int = 4) -> str:
    """An int with thousands separators; a float to `digits` significant digits (whole
    numbers from 1,000 up, where the digits after the point say nothing)."""
    if x is None:
        return DASH
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if math.isnan(x) or math.isinf(x):
        return DASH if math.isnan(x) else ("∞" if x > 0 else "-∞")
    if abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    text = f"{x:.{digits}g}"
    return text if "e" not in text else _short_exponent(text)


def _short_exponent(text: str) -> str:
    mantissa, _, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}"


def fixed(x: float | None, digits: int = 3) -> str:
    """`digits` significant digits, trailing zeros kept (1.40, 0.685): figures read side by
    side, such as a CI's two ends, line up."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return DASH
    if abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    return f"{x:#.{digits}g}".rstrip(".")


def ci(low: float | None, high: float | None) -> str:
    """A confidence interval: `[0.685, 1.38]`."""
    if low is None and high is None:
        return DASH
    return f"[{fixed(low)}, {fixed(high)}]"


def speedup(x: float | None, low: float | None = None, high: float | None = None) -> str:
    """`0.839x`, with its CI when given: `0.839x [0.685, 1.38]`."""
    if x is None:
        return DASH
    text = f"{fixed(x)}x"
    return text if low is None and high is None else f"{text} {ci(low, high)}"


def percent(fraction: float | None, digits: int = 3) -> str:
    """A share of 1 as a percentage: 0.8667 -> `86.7%`, 0 -> `0%`."""
    if fraction is None:
        return DASH
    return f"{number(100.0 * fraction, digits)}%"


def size(nbytes: float | None) -> str:
    """Bytes in SI units, 3 significant digits: `2.89 MB`, `74.4 GB`."""
    if nbytes is None:
        return DASH
    value, unit = float(nbytes), SIZE_UNITS[0]
    for unit in SIZE_UNITS:
        if abs(value) < 1000 or unit == SIZE_UNITS[-1]:
            break
        value /= 1000
    return f"{int(value)} {unit}" if unit == "B" else f"{number(value, 3)} {unit}"


def duration(seconds: float | None, precise: bool = False) -> str:
    """`1h 02m 05s`, `4m 00s`, `12s` (whole seconds: a stage's clock); `precise`: under a
    second in milliseconds (`42 ms`: a training step's time)."""
    if seconds is None:
        return DASH
    if precise and 0 < abs(seconds) < 1:
        return f"{number(seconds * 1000, 3)} ms"
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def clock(ts: float | None) -> str:
    """A UNIX time as UTC: `2026-11-29 14:05:12 UTC`."""
    if ts is None:
        return DASH
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def ago(ts: float | None, now: float) -> str:
    """How long ago `ts` was (or how far ahead): `12s ago`, `1h 02m 05s from now`."""
    if ts is None:
        return DASH
    delta = now - ts
    return f"{duration(abs(delta))} {'ago' if delta >= 0 else 'from now'}"


def label(key: str) -> str:
    """A field's key as words: `completion_tokens` -> `completion tokens`."""
    return str(key).replace("_", " ").strip()


def counts(mapping: Mapping[str, Any] | None, empty: str = "none") -> str:
    """`{'http_400': 2, 'timeout': 1}` -> `http_400 2, timeout 1`; nothing -> `none`."""
    if not mapping:
        return empty
    return ", ".join(f"{k} {value(v, str(k))}" for k, v in mapping.items())


def _kind(key: str) -> str | None:
    key = key.lower()
    if key == "bytes" or key.endswith(("_bytes", "bytes_total")):
        return "size"
    if key.endswith("per_s") or any(w in key for w in NOT_FRACTIONS):
        return None  # a rate per second, or a learning rate: a plain number
    if key.endswith("_s") or key in ("duration", "elapsed", "seconds"):
        return "duration"
    if any(w in key for w in FRACTION_WORDS):
        return "percent"
    if key == "ci" or key.endswith("_ci"):
        return "ci"
    return None


def value(v: Any, key: str = "") -> str:
    """Any value as a person reads it; `key` says what the number is (sizes, seconds, shares
    and CIs by their key's name)."""
    kind = _kind(key)
    if v is None:
        return DASH
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float) and kind == "size":
        return size(v)
    if isinstance(v, int | float) and kind == "duration":
        return duration(v, precise=True)
    if isinstance(v, float) and kind == "percent" and abs(v) <= 1:  # a share of 1, not a count
        return percent(v)
    if isinstance(v, int | float):
        return number(v)
    if isinstance(v, Mapping):
        return counts({k: x for k, x in v.items() if x is not None})
    if isinstance(v, list | tuple | set):
        items = list(v)
        if kind == "ci" and len(items) == 2:
            return ci(*items)
        return ", ".join(value(x) for x in items) if items else "none"
    return str(v)


def fields(mapping: Mapping[str, Any], drop: Iterable[str] = ()) -> dict[str, str]:
    """Every field as (words, readable value), leaving out empty ones (None) and `drop`."""
    dropped = set(drop)
    return {label(k): value(v, str(k)) for k, v in mapping.items() if v is not None and k not in dropped}


def markdown_table(rows: list[Mapping[str, Any]], columns: list[str] | None = None) -> str:
    """Rows as a markdown table, every cell through `value` (by its column's name)."""
    if not rows:
        return ""
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(label(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(value(row.get(c), c)) for c in columns) + " |")
    return fit_tables("\n".join(lines))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_ROW = re.compile(r"^\s*\|.*\|\s*$")


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip() for c in cells[1:-1]]


def fit_tables(markdown: str, max_columns: int = MAX_TABLE_COLUMNS) -> str:
    """Markdown whose tables have at most `max_columns` columns: a wider one is split into
    several, each repeating its first column, so that none runs off the UI's right edge."""
    lines, out, i = markdown.splitlines(), [], 0
    while i < len(lines):
        if not (_ROW.match(lines[i]) and i + 1 < len(lines) and set(lines[i + 1].replace(" ", "")) <= set("|-:")
                and "-" in lines[i + 1]):  # fmt: skip
            out.append(lines[i])
            i += 1
            continue
        j = i + 2
        while j < len(lines) and _ROW.match(lines[j]):
            j += 1
        out += _split_table([_split_row(line) for line in [lines[i], *lines[i + 2 : j]]], max_columns)
        i = j
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def _split_table(rows: list[list[str]], max_columns: int) -> list[str]:
    width = len(rows[0])
    if width <= max_columns:
        return _table_lines(rows)
    step = max(1, max_columns - 1)
    out: list[str] = []
    for start in range(1, width, step):
        part = [[row[0], *row[start : start + step]] for row in rows]
        out += ([""] if out else []) + _table_lines(part)
    return out


def _table_lines(rows: list[list[str]]) -> list[str]:
    header, *body = rows
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row + [""] * (len(header) - len(row))) + " |" for row in body]
