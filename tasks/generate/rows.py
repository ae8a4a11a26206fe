"""Schemas of committed generation rows and dead letters, and the quality flags over them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

ROW_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("prompt_id", pa.string()),
        ("sample_index", pa.int32()),
        ("output_ids", pa.list_(pa.int32())),
        ("text", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("cached_tokens", pa.int32()),
        ("latency_s", pa.float64()),
        ("engine", pa.string()),
        ("server", pa.string()),
        ("attempt", pa.string()),
    ]
)

DEAD_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("prompt_id", pa.string()),
        ("sample_index", pa.int32()),
        ("error_class", pa.string()),
        ("message", pa.string()),
        ("server", pa.string()),
        ("attempts", pa.int32()),
        ("attempt", pa.string()),
    ]
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# The `attempt` of a row copied from an earlier run (generate.reuse_from) instead of generated:
# reused-<that run's fingerprint hash>-<the journal attempt that copied it>.
REUSED_ATTEMPT_PREFIX = "reused-"


def is_reused(record: dict[str, Any]) -> bool:
    """Whether a row or journal record came from an earlier run rather than from the engine."""
    return str(record.get("attempt") or "").startswith(REUSED_ATTEMPT_PREFIX)


def to_table(records: Iterable[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    rows = sorted(records, key=lambda r: r["request_id"])
    return pa.Table.from_pylist(
        [{f.name: r.get(f.name) for f in schema} for r in rows], schema=schema
    )


def unterminated_think(text: str) -> bool:
    """A reasoning block opened and never closed: the response was cut inside its thinking."""
    opened = text.rfind(THINK_OPEN)
    return opened >= 0 and text.find(THINK_CLOSE, opened) < 0


def quality_flags(rows: pa.Table) -> dict[str, int]:
    reasons = rows.column("finish_reason").to_pylist()
    texts = rows.column("text").to_pylist()
    completion = rows.column("completion_tokens").to_pylist()
    return {
        "finish_length": sum(r == "length" for r in reasons),
        "empty_output": sum(
            n == 0 or not t.strip() for t, n in zip(texts, completion, strict=True)
        ),
        "unterminated_think": sum(unterminated_think(t) for t in texts),
    }
