"""What the discover stage hands back: three tables with fixed schemas and the report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tasks.discover.report import render_markdown

MANIFEST_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("messages", pa.string()),
        ("n_tokens", pa.int32()),
    ]
)
QUARANTINE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("domain", pa.string()),
        ("row_index", pa.int64()),
        ("reason", pa.string()),
        ("raw", pa.string()),
    ]
)
RAW_MAX_BYTES = 4096
_MARKDOWN_QUARANTINE_ROWS = 20


@dataclass(frozen=True)
class DiscoveryResult:
    """manifest/holdout: MANIFEST_SCHEMA sorted by prompt_id; quarantine: QUARANTINE_SCHEMA
    sorted by (source, row_index); report: JSON-ready counts (see report.build_report)."""

    manifest: pa.Table
    holdout: pa.Table
    quarantine: pa.Table
    report: dict[str, Any]

    def report_markdown(self) -> str:
        examples = self.quarantine.slice(0, _MARKDOWN_QUARANTINE_ROWS).to_pylist()
        return render_markdown(self.report, examples)


def truncate_raw(text: str, limit: int = RAW_MAX_BYTES) -> str:
    """At most `limit` UTF-8 bytes, marker included, never splitting a character."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    marker = f"...[truncated from {len(data)} bytes]"
    return data[: limit - len(marker)].decode("utf-8", "ignore") + marker
