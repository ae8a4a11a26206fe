"""Append-only per-shard journals: results are durable within a second of arriving.

Layout under <stage>/journal/<shard>/:
  local disk    <attempt>.jsonl              one file appended per attempt
  object store  <attempt>/<seq:08d>.jsonl    one immutable chunk per flush (no append there)
Attempt names sort by start time, so replay reads them in order. A torn last line (a crash
mid-write) fails to parse and is skipped.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from tasks.runfolder.folder import TMP_PREFIX, RunFolder

log = logging.getLogger(__name__)


def new_attempt_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{secrets.token_hex(3)}"


def journal_dir(stage: str, shard_id: str) -> str:
    return f"{stage}/journal/{shard_id}"


class JournalWriter:
    """Thread-safe appender for one shard attempt, flushed at least every `flush_s` seconds."""

    def __init__(self, run: RunFolder, stage: str, shard_id: str, attempt: str, flush_s: float = 1.0):
        self.run, self.flush_s = run, flush_s
        self.base = f"{journal_dir(stage, shard_id)}/{attempt}"
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._seq = 0
        self._file: IO[str] | None = None
        if run.is_local:
            path = run.path(self.base + ".jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, daemon=True, name="journal-flush")
        self._flusher.start()

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n"
        with self._lock:
            if self._file is not None:
                # Straight to the OS: a kill -9 of this process loses nothing written here;
                # the flusher's fsync covers a machine crash within flush_s.
                self._file.write(line)
                self._file.flush()
            else:
                self._pending.append(line)

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                os.fsync(self._file.fileno())
                return
            if not self._pending:
                return
            chunk, self._pending = "".join(self._pending), []
            self._seq += 1
            self.run.write_bytes_atomic(f"{self.base}/{self._seq:08d}.jsonl", chunk.encode())

    def _flush_loop(self) -> None:
        while not self._closed.wait(self.flush_s):
            try:
                self.flush()
            except Exception:  # the next flush or close() retries; the writer must not die
                log.exception("journal flush failed for %s", self.base)

    def close(self) -> None:
        self._closed.set()
        self._flusher.join()
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class JournalReplay:
    records: list[dict[str, Any]]
    torn_lines: int
    attempts: list[str]


def _parse_lines(text: str, where: str) -> tuple[list[dict[str, Any]], int]:
    records, torn = [], 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
            log.warning("skipping torn journal line %s:%d", where, lineno)
    return records, torn


def read_journal(run: RunFolder, stage: str, shard_id: str) -> JournalReplay:
    """Every record of every attempt of a shard, in attempt order then write order."""
    base = journal_dir(stage, shard_id)
    records: list[dict[str, Any]] = []
    torn = 0
    attempts = []
    for name in run.listdir(base):
        if name.startswith(TMP_PREFIX):
            continue
        if name.endswith(".jsonl"):
            attempts.append(name.removesuffix(".jsonl"))
            parts = [f"{base}/{name}"]
        else:
            attempts.append(name)
            parts = [f"{base}/{name}/{c}" for c in run.listdir(f"{base}/{name}") if c.endswith(".jsonl")]
        for rel in parts:
            got, bad = _parse_lines(run.read_bytes(rel).decode("utf-8", "replace"), rel)
            records.extend(got)
            torn += bad
    return JournalReplay(records, torn, attempts)
