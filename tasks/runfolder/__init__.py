"""The run folder and its commit protocol (docs/DESIGN.md §2), on any fsspec filesystem."""

from tasks.runfolder.fingerprint import (
    FingerprintMismatch,
    check_fingerprint,
    content_hash,
    ensure_fingerprint,
    fingerprint_hash,
    request_id,
)
from tasks.runfolder.folder import (
    RunFolder,
    RunRootUnwritable,
    check_writable,
    unwritable,
    unwritable_error,
)
from tasks.runfolder.journal import JournalReplay, JournalWriter, new_attempt_id, read_journal
from tasks.runfolder.leases import (
    Lease,
    LeaseLost,
    LeaseTable,
    LeaseView,
    holder_label,
    read_leases,
)
from tasks.runfolder.parts import PartWriter, marker_parts
from tasks.runfolder.shards import (
    CommitConflict,
    CommitError,
    CommitResult,
    CorruptShard,
    ShardCommit,
    ShardStore,
)

__all__ = [
    "CommitConflict",
    "CommitError",
    "CommitResult",
    "CorruptShard",
    "FingerprintMismatch",
    "JournalReplay",
    "JournalWriter",
    "Lease",
    "LeaseLost",
    "LeaseTable",
    "LeaseView",
    "PartWriter",
    "RunFolder",
    "RunRootUnwritable",
    "ShardCommit",
    "ShardStore",
    "check_fingerprint",
    "check_writable",
    "content_hash",
    "ensure_fingerprint",
    "fingerprint_hash",
    "holder_label",
    "marker_parts",
    "new_attempt_id",
    "read_leases",
    "read_journal",
    "request_id",
    "unwritable",
    "unwritable_error",
]
