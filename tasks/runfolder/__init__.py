"""The run folder and its commit protocol (DESIGN §3), on any fsspec filesystem."""

from tasks.runfolder.fingerprint import (
    FingerprintMismatch,
    check_fingerprint,
    content_hash,
    ensure_fingerprint,
    fingerprint_hash,
    request_id,
)
from tasks.runfolder.folder import RunFolder
from tasks.runfolder.journal import JournalReplay, JournalWriter, new_attempt_id, read_journal
from tasks.runfolder.parts import PartWriter, marker_parts
from tasks.runfolder.shards import CommitConflict, CommitError, CommitResult, ShardStore

__all__ = [
    "CommitConflict",
    "CommitError",
    "CommitResult",
    "FingerprintMismatch",
    "JournalReplay",
    "JournalWriter",
    "PartWriter",
    "RunFolder",
    "ShardStore",
    "check_fingerprint",
    "content_hash",
    "ensure_fingerprint",
    "fingerprint_hash",
    "marker_parts",
    "new_attempt_id",
    "read_journal",
    "request_id",
]
