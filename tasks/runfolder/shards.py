"""Committed shards: verify, write, then mark. A shard exists only once its marker does.

    <stage>/data/<shard>.<attempt>.parquet   rows (named by the marker, so racing writers
    <stage>/dead/<shard>.<attempt>.parquet   never overwrite each other's data)
    <stage>/_SUCCESS/<shard>.json            marker: sha256 of both files, counts, fingerprint
    <stage>/_COMPLETE                        no more shards will come for this stage

A shard too big for one object commits its data as parts written during the attempt
(`part_writer`, then `commit_parts`; layout in `parts`); the marker lists them.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.errors import ExpectedFailure
from tasks.runfolder.failpoint import failpoint
from tasks.runfolder.fingerprint import canonical_json
from tasks.runfolder.folder import TMP_PREFIX, RunFolder
from tasks.runfolder.parts import PartWriter, marker_parts, marker_paths

log = logging.getLogger(__name__)


class CommitError(RuntimeError):
    """A shard failed verification before commit; nothing of it is left written."""


class CorruptShard(CommitError, ExpectedFailure):
    """Committed bytes differ from what their marker records (size or sha256), a file it names
    is gone, or a marker is not valid JSON. The message names the file and the fix."""


def redo_hint(marker_key: str) -> str:
    """The fix for a damaged committed shard, whatever the stage: without its marker the shard
    is not committed, and the next run of the stage does it again (generation from its
    journal, sending only what no journal holds; extraction from the generation shard)."""
    return f"delete {marker_key} and resume: the stage runs that shard again"


class CommitConflict(RuntimeError):
    """The shard's data vanished under its fresh marker (a concurrent cleanup): commit again."""


@dataclass(frozen=True)
class ShardCommit:
    """One attempt's commit of one shard, all but its data: what the marker records beside the
    data's own fields, and what the data's keys are verified against. The stage that commits
    builds one and hands it whole to `commit`, `commit_payload` or `commit_parts`."""

    shard_id: str
    # Names the attempt's files (`<shard>.<attempt>.*`, so racing writers never overwrite
    # each other's) and is recorded in the marker.
    attempt: str
    fingerprint_hash: str  # the fingerprint the shard was made under, recorded in the marker
    # Every key the plan holds (any iterable; kept as a frozenset): each must be a row or a
    # dead letter, exactly once.
    planned_keys: frozenset[str]
    dead: pa.Table  # the dead letters (a `key` column), written beside the data
    key: str = "request_id"  # the key column of `dead`, and of parquet rows
    extra: dict[str, Any] | None = None  # the stage's own marker fields (counts, settings)
    # Re-commit a marked shard (retry-dead, a rebuild): the marker is overwritten, not
    # created exclusively, and the files of the attempt it named are removed.
    replace: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "planned_keys", frozenset(self.planned_keys))


@dataclass(frozen=True)
class CommitResult:
    marker: dict[str, Any]
    won: bool  # False when another writer had already committed this shard


def table_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verify_keys(
    shard_id: str, row_keys: list[str], dead_keys: list[str], planned: frozenset[str]
) -> None:
    problems = []
    if len(set(row_keys)) != len(row_keys):
        problems.append(f"{len(row_keys) - len(set(row_keys))} duplicate keys in rows")
    if len(set(dead_keys)) != len(dead_keys):
        problems.append(f"{len(dead_keys) - len(set(dead_keys))} duplicate keys in dead letters")
    both = set(row_keys) & set(dead_keys)
    if both:
        problems.append(f"{len(both)} keys both committed and dead")
    got = set(row_keys) | set(dead_keys)
    if got - planned:
        problems.append(f"{len(got - planned)} keys not in the plan")
    if planned - got:
        problems.append(f"{len(planned - got)} planned keys missing")
    if problems:
        raise CommitError(f"shard {shard_id} failed verification: " + "; ".join(problems))


class ShardStore:
    """The committed shards of one stage (generate, extract, ...) under a run root."""

    def __init__(self, run: RunFolder, stage: str):
        self.run, self.stage = run, stage
        # name -> (size, modification stamp, marker): a scan that runs every few seconds for
        # days reads only markers that are new or rewritten (one LIST, not one GET per shard).
        self._markers: dict[str, tuple[Any, Any, dict[str, Any]]] = {}

    def marker_key(self, shard_id: str) -> str:
        return f"{self.stage}/_SUCCESS/{shard_id}.json"

    def marker(self, shard_id: str) -> dict[str, Any] | None:
        return self._read_marker(self.marker_key(shard_id))

    def _read_marker(self, rel: str) -> dict[str, Any] | None:
        try:
            return self.run.read_json(rel)
        except ValueError as e:  # markers are linked into place whole: only damage tears one
            raise CorruptShard(
                f"{self.run.url}/{rel}: the commit marker is not valid JSON ({e}); "
                f"fix: {redo_hint(rel)}"
            ) from None

    def committed(self) -> dict[str, dict[str, Any]]:
        """shard_id -> marker for every marked shard (the markers are trusted as written last)."""
        full = self.run.path(f"{self.stage}/_SUCCESS")
        self.run.fs.invalidate_cache(full)
        try:
            entries = self.run.fs.ls(full, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if not name.endswith(".json") or name.startswith(TMP_PREFIX):
                continue
            stamp = entry.get("ETag") or entry.get("mtime") or entry.get("LastModified")
            cached = self._markers.get(name)
            if stamp is not None and cached is not None and cached[:2] == (entry.get("size"), stamp):
                out[name.removesuffix(".json")] = cached[2]
                continue
            marker = self._read_marker(f"{self.stage}/_SUCCESS/{name}")
            if marker is not None:
                out[name.removesuffix(".json")] = marker
                if stamp is not None:
                    self._markers[name] = (entry.get("size"), stamp, marker)
        return out

    def commit(self, rows: pa.Table, shard: ShardCommit) -> CommitResult:
        """Commit parquet rows: serialize, read back, then `commit_payload`."""
        data = table_bytes(rows)
        # Read the serialized bytes back before they go anywhere: a schema or encoding fault
        # fails here, with nothing written.
        back = pq.read_table(io.BytesIO(data))
        if back.num_rows != rows.num_rows or back.schema != rows.schema:
            raise CommitError(f"shard {shard.shard_id}: parquet round-trip changed rows or schema")
        return self.commit_payload(data, "parquet", back.column(shard.key).to_pylist(), shard)

    def commit_payload(
        self, data: bytes, suffix: str, row_keys: list[str], shard: ShardCommit
    ) -> CommitResult:
        """temp -> verify -> atomic write -> marker, for any payload format in one object.

        `row_keys` must be the keys decoded back from `data` by the caller (the stage knows
        its format); they are checked against the plan and the dead letters here.
        """
        dead_keys = shard.dead.column(shard.key).to_pylist()
        _verify_keys(shard.shard_id, row_keys, dead_keys, shard.planned_keys)
        data_key = f"{self.stage}/data/{shard.shard_id}.{shard.attempt}.{suffix}"
        self.run.write_bytes_atomic(data_key, data)
        failpoint("commit.after_data")
        fields = {"data": data_key, "sha256": sha256_hex(data), "bytes": len(data)}
        return self._mark(shard, fields, len(row_keys))

    def part_writer(self, shard_id: str, attempt: str, suffix: str) -> PartWriter:
        """Start a multi-part attempt: write its parts as they fill, then `commit_parts`."""
        return PartWriter(self.run, self.stage, shard_id, attempt, suffix)

    def commit_parts(
        self, parts: PartWriter, row_keys: list[str], shard: ShardCommit
    ) -> CommitResult:
        """verify -> dead letters -> marker listing the parts already written, in order.

        `row_keys` are the keys decoded back from every part, in part order. A shard that
        fails verification removes its parts (CommitError); so does a losing writer.
        `shard` names the parts' own shard and attempt.
        """
        shard_id = parts.shard_id
        if (shard.shard_id, shard.attempt) != (shard_id, parts.attempt):
            raise ValueError(
                f"parts of shard {shard_id} attempt {parts.attempt} committed as shard "
                f"{shard.shard_id} attempt {shard.attempt}"
            )
        try:
            if parts.rows != len(row_keys):
                raise CommitError(
                    f"shard {shard_id}: its {len(parts.parts)} parts hold {parts.rows} rows "
                    f"but {len(row_keys)} keys were given"
                )
            dead_keys = shard.dead.column(shard.key).to_pylist()
            _verify_keys(shard_id, row_keys, dead_keys, shard.planned_keys)
        except CommitError:
            parts.abort()
            raise
        if not parts.parts:  # every row dead: the same crash point as after a data write
            failpoint("commit.after_data")
        return self._mark(shard, {"parts": list(parts.parts)}, len(row_keys))

    def _mark(self, shard: ShardCommit, data_fields: dict[str, Any], rows: int) -> CommitResult:
        """Write the dead letters, then create the marker (exclusively unless `replace`)."""
        shard_id, attempt, dead = shard.shard_id, shard.attempt, shard.dead
        dead_key = f"{self.stage}/dead/{shard_id}.{attempt}.parquet"
        dead_data = table_bytes(dead)
        self.run.write_bytes_atomic(dead_key, dead_data)
        failpoint("commit.before_marker")
        marker = {
            "shard_id": shard_id,
            "stage": self.stage,
            **data_fields,
            "rows": rows,
            "dead_path": dead_key,
            "dead_sha256": sha256_hex(dead_data),
            "dead_bytes": len(dead_data),
            "dead": dead.num_rows,
            "fingerprint": shard.fingerprint_hash,
            "attempt": attempt,
            "committed_at": time.time(),
            **(shard.extra or {}),
        }
        body = canonical_json(marker).encode()
        if shard.replace:
            previous = self.marker(shard_id)
            self.run.write_bytes_atomic(self.marker_key(shard_id), body)
            if previous and previous.get("attempt") != attempt:
                self._remove_files(previous)
            won = True
        else:
            won = self.run.create_exclusive(self.marker_key(shard_id), body)
        failpoint("commit.after_marker")
        if not won:
            log.info("shard %s was committed by another writer; dropping attempt %s", shard_id, attempt)
            self._remove_files(marker)
            return CommitResult(self.marker(shard_id) or {}, won=False)
        if not self._files_intact(marker):
            self.run.remove(self.marker_key(shard_id))
            raise CommitConflict(f"shard {shard_id}: data vanished right after commit; retrying")
        return CommitResult(marker, won=True)

    def _files_intact(self, marker: dict[str, Any]) -> bool:
        """Every object the fresh marker names is there. Parts are checked by size only
        (re-reading a 100 GB shard here would double its I/O); readers verify their sha256."""
        try:
            if "parts" in marker:
                for part in marker["parts"]:
                    if int(self.run.info(part["path"])["size"]) != part["bytes"]:
                        return False
            elif sha256_hex(self.run.read_bytes(marker["data"])) != marker["sha256"]:
                return False
            return sha256_hex(self.run.read_bytes(marker["dead_path"])) == marker["dead_sha256"]
        except FileNotFoundError:
            return False

    def damaged(
        self, markers: dict[str, dict[str, Any]], hash_data: bool = False
    ) -> dict[str, str]:
        """shard_id -> what is wrong, for the given markers whose files are missing, of
        another size than recorded, or (`hash_data`) of another sha256. Dead letters are
        always hashed (a few KB each).

        Sizes cost one LIST per folder (a page per 1,000 objects on S3), not a request per
        object, so a resume can check every committed object of a 40-hour run each time.
        A sha256 needs every byte read: worth it where the data is small (generation's
        text) or where the bytes are read anyway (every reader verifies them)."""
        sizes: dict[str, int] = {}
        for sub in ("data", "dead"):
            full = self.run.path(f"{self.stage}/{sub}")
            self.run.fs.invalidate_cache(full)
            try:
                entries = self.run.fs.ls(full, detail=True)
            except FileNotFoundError:
                continue
            for entry in entries:
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                sizes[f"{self.stage}/{sub}/{name}"] = int(entry.get("size") or 0)
        out = {}
        for shard_id, marker in markers.items():
            problem = self._damage(marker, sizes, hash_data)
            if problem:
                out[shard_id] = problem
        return out

    def _damage(self, marker: dict[str, Any], sizes: dict[str, int], hash_data: bool) -> str | None:
        dead = {"path": marker["dead_path"], "sha256": marker["dead_sha256"], "bytes": marker.get("dead_bytes")}
        for entry, hashed in [*((p, hash_data) for p in marker_parts(marker)), (dead, True)]:
            rel, want = entry["path"], entry.get("bytes")
            if rel not in sizes:
                return f"{self.run.url}/{rel} is missing"
            if want is not None and sizes[rel] != int(want):
                return f"{self.run.url}/{rel} has {sizes[rel]:,} bytes, its marker records {int(want):,}"
            if hashed:
                try:
                    data = self.run.read_bytes(rel)
                except FileNotFoundError:
                    return f"{self.run.url}/{rel} is missing"
                if sha256_hex(data) != entry["sha256"]:
                    return f"{self.run.url}/{rel}: sha256 differs from its marker's"
        return None

    def _remove_files(self, marker: dict[str, Any]) -> None:
        for path in marker_paths(marker):
            self.run.remove(path)

    def read_rows(self, marker: dict[str, Any]) -> pa.Table:
        return pq.read_table(io.BytesIO(self.read_payload(marker)))

    def read_payload(self, marker: dict[str, Any]) -> bytes:
        """The committed data object's bytes, refused when they do not match the marker.
        Single-object shards only: a multi-part shard is read with `iter_parts`."""
        if "parts" in marker:
            raise CommitError(
                f"{self.run.url}/{self.marker_key(marker['shard_id'])}: the shard has "
                f"{len(marker['parts'])} data parts; read them with read_part/iter_parts"
            )
        return self._verified_bytes(marker["data"], marker["sha256"], marker["shard_id"])

    def read_part(self, marker: dict[str, Any], index: int) -> bytes:
        """Data part `index` of a committed shard (a single-object shard is part 0),
        refused when its bytes do not match the marker's sha256."""
        parts = marker_parts(marker)
        if not 0 <= index < len(parts):
            raise IndexError(
                f"{self.run.url}/{self.marker_key(marker['shard_id'])}: part {index} of "
                f"{len(parts)}"
            )
        return self._verified_bytes(parts[index]["path"], parts[index]["sha256"], marker["shard_id"])

    def iter_parts(self, marker: dict[str, Any]) -> Iterator[bytes]:
        """The shard's data parts in order, each read and verified only when reached."""
        for index in range(len(marker_parts(marker))):
            yield self.read_part(marker, index)

    def read_dead(self, marker: dict[str, Any]) -> pa.Table:
        dead = self._verified_bytes(marker["dead_path"], marker["dead_sha256"], marker["shard_id"])
        return pq.read_table(io.BytesIO(dead))

    def _verified_bytes(self, rel: str, sha: str, shard_id: str) -> bytes:
        try:
            data = self.run.read_bytes(rel)
        except FileNotFoundError:
            problem = "the file is missing"
        else:
            if sha256_hex(data) == sha:
                return data
            problem = "sha256 does not match its marker (damaged since its commit)"
        raise CorruptShard(
            f"{self.run.url}/{rel}: {problem}; fix: {redo_hint(self.marker_key(shard_id))}"
        )

    def cleanup(
        self, min_age_s: float = 0.0, protected: Callable[[], Collection[str]] | None = None
    ) -> list[str]:
        """Remove temp objects and data (parts included) no marker names: left by a crash
        mid-commit. `protected()` names shards being worked on right now (their live
        leases): their objects are kept, since an attempt's parts have no marker yet.
        `min_age_s` spares recent objects where no leases are kept.

        Order matters for a writer racing this call: objects are listed first, then the
        leases, then the markers. An object listed here whose shard has no live lease
        afterwards was written under a lease since released (committed: its marker is then
        visible below) or abandoned (a stray)."""
        listed = []
        for sub in ("data", "dead", "_SUCCESS"):
            listed += [(sub, name) for name in self.run.listdir(f"{self.stage}/{sub}")]
        spared = set(protected()) if protected is not None else set()
        named: set[str] = set()
        for marker in self.committed().values():
            named.update(marker_paths(marker))
        removed = []
        now = time.time()
        for sub, name in listed:
            rel = f"{self.stage}/{sub}/{name}"
            stray = name.startswith(TMP_PREFIX) or (sub != "_SUCCESS" and rel not in named)
            if not stray or _shard_of(name) in spared:
                continue
            if _age(self.run, rel, now) >= min_age_s:
                self.run.remove(rel)
                removed.append(rel)
        if removed:
            log.info("cleaned %d uncommitted objects under %s/%s", len(removed), self.run.url, self.stage)
        return removed

    def mark_complete(self, summary: dict[str, Any]) -> None:
        self.run.write_json_atomic(f"{self.stage}/_COMPLETE", {"completed_at": time.time(), **summary})

    def is_complete(self) -> bool:
        return self.run.exists(f"{self.stage}/_COMPLETE")


def _shard_of(name: str) -> str:
    """The shard id of a data, dead-letter or marker object name (`<shard>.<attempt>...`,
    `<shard>.json`, or either behind a temp prefix)."""
    if name.startswith(TMP_PREFIX):
        name = name[len(TMP_PREFIX) :].partition("-")[2]
    return name.split(".", 1)[0]


def _age(run: RunFolder, rel: str, now: float) -> float:
    try:
        info = run.info(rel)
    except FileNotFoundError:
        return 0.0
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
    if mtime is None:
        return float("inf")
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return now - float(mtime)
