"""`discover.holdout_from`: an earlier run's held-out set, kept as this run's.

A draft trained on more data is only comparable with the earlier ones (gate accept lengths, the
data-scaling curve) when it is measured on the same prompts, and a seeded pick over a grown
candidate pool picks different ones. So the earlier holdout table is read before any source, and
every problem with it (no such path, a run root without committed discovery, a table that is not
a holdout table, a domain this config does not give) is a config error naming the file.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from tasks.config import DiscoverConfig
from tasks.discover.commit import discovery_marker, read_prompts_table
from tasks.discover.domains import declared_domains
from tasks.discover.formats import prompt_id_of
from tasks.discover.mixture import DiscoverConfigError
from tasks.discover.result import MANIFEST_SCHEMA
from tasks.redaction import redact_url
from tasks.runfolder import RunFolder, content_hash
from tasks.runfolder.layout import DISCOVERY_MARKER


@dataclass(frozen=True)
class PinnedHoldout:
    table_path: str  # the parquet file read, for messages (redacted)
    rows: dict[str, dict[str, Any]]  # prompt_id -> its row as recorded (MANIFEST_SCHEMA columns)

    def ids_hash(self) -> str:
        """Content hash of the held-out set (prompt ids are content hashes of the messages)."""
        return content_hash(sorted(self.rows), 16)

    def per_domain(self) -> dict[str, int]:
        return dict(sorted(Counter(row["domain"] for row in self.rows.values()).items()))


def _fail(where: str, what: str) -> DiscoverConfigError:
    return DiscoverConfigError(f"discover.holdout_from: {redact_url(where)}: {what}")


def _read_table(path: str, storage_options: dict[str, Any] | None) -> tuple[pa.Table, str]:
    """The holdout table at `path` (a run root or the parquet file) and the file it came from."""
    try:
        fs, fs_path = url_to_fs(path, **(storage_options or {}))
        exists, is_dir = fs.exists(fs_path), fs.isdir(fs_path)
    except Exception as e:  # filesystem drivers raise their own exception types
        raise _fail(path, f"cannot open it: {type(e).__name__}: {e}") from None
    if not exists:
        raise _fail(path, "no such run folder or holdout parquet file")
    if not is_dir:
        try:
            with fs.open(fs_path, "rb") as f:
                return pq.read_table(f), path
        except Exception as e:
            raise _fail(path, f"not a parquet file: {type(e).__name__}: {e}") from None
    run = RunFolder(path, storage_options)
    marker = discovery_marker(run)
    if marker is None:
        raise _fail(
            path,
            f"no committed discovery ({DISCOVERY_MARKER}); give a run root whose discover stage "
            "has finished, or its holdout parquet file",
        )
    holdout = (marker.get("files") or {}).get("holdout") if isinstance(marker, dict) else None
    if not isinstance(holdout, dict) or "path" not in holdout:
        raise _fail(path, f"its {DISCOVERY_MARKER} names no holdout table (files.holdout): not a committed discovery")
    # Verified against the marker's sha256, like every reader of a committed prompts table.
    return read_prompts_table(run, "holdout"), f"{run.url}/{holdout['path']}"


def holdout_table(path: str, storage_options: dict[str, Any] | None = None) -> pa.Table:
    """The holdout table `discover.holdout_from` names (a run root's, verified, or the file)."""
    return _read_table(path, storage_options)[0]


def load_pinned_holdout(
    cfg: DiscoverConfig, storage_options: dict[str, Any] | None = None
) -> PinnedHoldout | None:
    """The held-out set `cfg.holdout_from` names, checked; None when it is not set."""
    if cfg.holdout_from is None:
        return None
    table, where = _read_table(cfg.holdout_from, storage_options)
    missing = [name for name in MANIFEST_SCHEMA.names if name not in table.column_names]
    if missing:
        raise _fail(
            where,
            f"no column(s) {missing}: not a holdout table (its columns: {MANIFEST_SCHEMA.names})",
        )
    if table.num_rows == 0:
        # A pinned empty set would gate on nothing, silently.
        raise _fail(where, "holds no prompts")
    domains = declared_domains(cfg)
    rows: dict[str, dict[str, Any]] = {}
    for row in table.select(MANIFEST_SCHEMA.names).to_pylist():
        prompt_id = row["prompt_id"]
        if row["domain"] not in domains:
            raise _fail(
                where,
                f"prompt {prompt_id} has domain {row['domain']!r}, which no source or domain rule "
                f"of this config gives (domains: {domains}); declare it, or unset holdout_from",
            )
        if prompt_id in rows:
            raise _fail(where, f"prompt {prompt_id} is listed twice")
        # Decontamination compares these messages, and the held-out set is named by these ids.
        try:
            matches = prompt_id_of(json.loads(row["messages"])) == prompt_id
        except (TypeError, ValueError):
            matches = False
        if not matches:
            raise _fail(where, f"prompt {prompt_id}: its messages do not hash to its prompt_id")
        rows[prompt_id] = row
    return PinnedHoldout(redact_url(where), rows)
