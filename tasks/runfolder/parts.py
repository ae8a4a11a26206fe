"""Multi-part shard data: one shard attempt written as several objects under one marker.

A shard too big for one object (host memory, a single hash pass, S3's 5 GB PUT) is written
part by part while it is produced:

    <stage>/data/<shard>.<attempt>.p0000.<suffix>, .p0001, ...

each part atomically, its sha256 taken from the bytes in memory as it is written. The parts
mean nothing until `ShardStore.commit_parts` writes the marker that lists them, in order,
as [{"path", "sha256", "rows", "bytes"}]. Single-object markers ("data", "sha256") read as
a marker of one part (`marker_parts`), so readers handle both.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from tasks.runfolder.failpoint import failpoint

if TYPE_CHECKING:
    from tasks.runfolder.folder import RunFolder

Buffer = bytes | bytearray | memoryview


def part_key(stage: str, shard_id: str, attempt: str, index: int, suffix: str) -> str:
    return f"{stage}/data/{shard_id}.{attempt}.p{index:04d}.{suffix}"


def marker_parts(marker: dict[str, Any]) -> list[dict[str, Any]]:
    """The data objects a marker names, in order: its parts, or its one "data" object."""
    if "parts" in marker:
        return list(marker["parts"])
    return [
        {
            "path": marker["data"],
            "sha256": marker["sha256"],
            "rows": marker["rows"],
            "bytes": marker.get("bytes"),
        }
    ]


def marker_paths(marker: dict[str, Any]) -> list[str]:
    """Every object a marker names: its data part(s) and its dead letters."""
    return [p["path"] for p in marker_parts(marker)] + [marker["dead_path"]]


class PartWriter:
    """The data parts of one shard attempt, written in order as the caller produces them."""

    def __init__(self, run: RunFolder, stage: str, shard_id: str, attempt: str, suffix: str):
        self.run, self.stage = run, stage
        self.shard_id, self.attempt, self.suffix = shard_id, attempt, suffix
        self.parts: list[dict[str, Any]] = []

    def write(self, data: Buffer, rows: int) -> dict[str, Any]:
        """Write the next part atomically; returns its marker entry."""
        key = part_key(self.stage, self.shard_id, self.attempt, len(self.parts), self.suffix)
        size = memoryview(data).nbytes
        sha = hashlib.sha256(data).hexdigest()
        self.run.write_bytes_atomic(key, data)
        entry = {"path": key, "sha256": sha, "rows": rows, "bytes": size}
        self.parts.append(entry)
        if len(self.parts) == 1:
            failpoint("commit.after_data")
        failpoint("commit.after_part")
        return entry

    @property
    def rows(self) -> int:
        return sum(p["rows"] for p in self.parts)

    @property
    def bytes(self) -> int:
        return sum(p["bytes"] for p in self.parts)

    def abort(self) -> None:
        """Remove every part written so far (an attempt that will not commit)."""
        for part in self.parts:
            self.run.remove(part["path"])
        self.parts = []
