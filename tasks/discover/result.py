"""What the discover stage hands back: four tables with fixed schemas and the report.

Every row read ends up in exactly one of them: the manifest (kept), the holdout, the quarantine
(rows that cannot be a prompt: fix the data) or `filtered` (valid prompts left out by a rule:
script, length, dedupe, decontamination, mixture caps). Keeping policy drops apart from
malformed rows lets the quarantine stay a to-do list for the data, while `filtered` says, row by
row, what each setting cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tasks.discover.report import filtered_examples, render_markdown

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
        ("user_turn", pa.int32()),  # every_user: the user turn from which the row gives no prompt
        ("reason", pa.string()),
        ("raw", pa.string()),
    ]
)
FILTERED_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("domain", pa.string()),
        ("row_index", pa.int64()),
        ("user_turn", pa.int32()),  # every_user: the user turn the prompt ends at; else null
        ("prompt_id", pa.string()),
        ("reason", pa.string()),  # the report's outcome name: too_long, non_latin, ...
        ("detail", pa.string()),  # the measured value against the setting, or the kept copy
        ("n_tokens", pa.int32()),  # null when the row was dropped before the length check
        ("latin_fraction", pa.float64()),  # non_latin rows only
        ("duplicate_of", pa.string()),  # the prompt_id kept in its place (dedupe, holdout)
    ]
)
RAW_MAX_BYTES = 4096
_MARKDOWN_EXAMPLE_ROWS = 20


@dataclass(frozen=True)
class DiscoveryResult:
    """manifest/holdout: MANIFEST_SCHEMA sorted by prompt_id; quarantine: QUARANTINE_SCHEMA and
    filtered: FILTERED_SCHEMA, both sorted by (source, row_index, user_turn); report: JSON-ready counts
    derived from these tables (see report.build_report)."""

    manifest: pa.Table
    holdout: pa.Table
    quarantine: pa.Table
    filtered: pa.Table
    report: dict[str, Any]

    def tables(self) -> dict[str, pa.Table]:
        return {
            "manifest": self.manifest,
            "holdout": self.holdout,
            "quarantine": self.quarantine,
            "filtered": self.filtered,
        }

    def report_markdown(self) -> str:
        return render_markdown(
            self.report,
            self.quarantine.slice(0, _MARKDOWN_EXAMPLE_ROWS).to_pylist(),
            filtered_examples(
                self.filtered.select(["source", "row_index", "user_turn", "reason", "detail"]).to_pylist()
            ),
        )


def truncate_raw(text: str, limit: int = RAW_MAX_BYTES) -> str:
    """At most `limit` UTF-8 bytes, marker included, never splitting a character."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    marker = f"...[truncated from {len(data)} bytes]"
    return data[: limit - len(marker)].decode("utf-8", "ignore") + marker
