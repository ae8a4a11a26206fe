"""The discover stage's output in the run folder: written, then marked by prompts/_SUCCESS.json."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.runfolder import FingerprintMismatch, RunFolder, content_hash
from tasks.runfolder.layout import DISCOVERY_MARKER, DISCOVERY_REPORT
from tasks.runfolder.shards import sha256_hex, table_bytes

# Every table the marker covers: the prompts (manifest, holdout) and every row left out
# (quarantine: malformed; filtered: dropped by a setting), each verified by its sha256.
TABLES = ("manifest", "holdout", "quarantine", "filtered")


def manifest_hash(manifest: pa.Table) -> str:
    """Content hash of the prompt set (prompt ids are content hashes of the messages)."""
    return content_hash(sorted(manifest.column("prompt_id").to_pylist()), 16)


def discovery_marker(run: RunFolder) -> dict[str, Any] | None:
    return run.read_json(DISCOVERY_MARKER)


def check_discovery_config(run: RunFolder, config_hash: str, allow_change: bool) -> bool:
    """True when prompts/ is already committed for this discovery config (skip the stage)."""
    marker = discovery_marker(run)
    if marker is None:
        return False
    if marker["config_hash"] == config_hash:
        return True
    if allow_change:
        return False
    raise FingerprintMismatch(
        f"{run.url}/prompts was discovered with a different discover config "
        f"(config_hash {marker['config_hash']} -> {config_hash}); the committed manifest is kept. "
        f"Use a new run root, or allow_fingerprint_change to rediscover."
    )


def commit_discovery(
    run: RunFolder,
    tables: dict[str, pa.Table],
    report: dict[str, Any],
    report_md: str,
    config_hash: str,
) -> dict[str, Any]:
    """Write the tables and the report, then the marker that makes them count."""
    if set(tables) != set(TABLES):
        raise ValueError(f"commit_discovery needs the tables {list(TABLES)}, got {sorted(tables)}")
    files = {}
    for name in TABLES:
        data = table_bytes(tables[name])
        run.write_bytes_atomic(f"prompts/{name}.parquet", data)
        files[name] = {"path": f"prompts/{name}.parquet", "sha256": sha256_hex(data), "rows": tables[name].num_rows}
    run.write_bytes_atomic(DISCOVERY_REPORT, json.dumps(report, indent=2, default=str).encode())
    run.write_bytes_atomic("prompts/discovery_report.md", report_md.encode())
    marker = {
        "config_hash": config_hash,
        "manifest_hash": manifest_hash(tables["manifest"]),
        "files": files,
        "committed_at": time.time(),
    }
    run.write_json_atomic(DISCOVERY_MARKER, marker)
    return marker


def read_prompts_table(run: RunFolder, name: str) -> pa.Table:
    """A committed prompts table, verified against the marker's sha256."""
    marker = discovery_marker(run)
    if marker is None:
        raise FileNotFoundError(f"{run.url}/prompts has no committed discovery (run the discover stage)")
    entry = marker["files"][name]
    data = run.read_bytes(entry["path"])
    if sha256_hex(data) != entry["sha256"]:
        raise RuntimeError(f"{run.url}/{entry['path']}: sha256 does not match {DISCOVERY_MARKER}")
    return pq.read_table(io.BytesIO(data))
