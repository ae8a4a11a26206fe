"""`generate.reuse_from`: an earlier run's committed replies, journaled here for the same requests.

Prompt ids are content hashes of the messages, so a prompt an earlier run regenerated has the same
id in a run whose prompt set grew; with the same target and sampling, its reply is one this run
would generate. So before a shard runs, each of its requests that the earlier run committed is
written to the shard's journal as an ok outcome that cost no request (`attempts` 0), and the shard
then runs as any resumed shard does: its replay finds those done, it sends only the others and
commits once. Request ids hash each run's own fingerprint (its manifest included), so the earlier
rows are matched on (prompt_id, sample_index) and journaled under this run's request ids.

Everything that makes the earlier run unusable (no such folder, not a run, no committed shard, a
different target or sampling) is refused when the stage prepares, before any request is sent and
with nothing written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from fsspec.core import url_to_fs

from tasks.config import ConfigError
from tasks.generate.plan import PlannedRequest, ShardPlan
from tasks.generate.rows import REUSED_ATTEMPT_PREFIX
from tasks.generate.shard import STAGE, replay_journal
from tasks.redaction import redact_url
from tasks.runfolder import (
    CorruptShard,
    FingerprintMismatch,
    JournalWriter,
    RunFolder,
    ShardStore,
    new_attempt_id,
)
from tasks.runfolder.fingerprint import RUN_JSON, diff_fingerprints
from tasks.runfolder.layout import SHARD_PLAN

log = logging.getLogger(__name__)

# What shapes a reply: the weights, tokenizer, chat template and context (the target's identity)
# and the sampling. The code version is left out, or every release would refuse every earlier
# run; the engine is in no fingerprint (each row records its own).
COMPARED = ("target", "sampling")
# The reply, copied as the earlier run committed it; the rest of the record is this run's.
COPIED = (
    "output_ids",
    "text",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "latency_s",
    "engine",
    "server",
)


def _refused(where: str, what: str) -> ConfigError:
    return ConfigError(f"generate.reuse_from: {where}: {what}; nothing was sent")


@dataclass
class EarlierRun:
    """An earlier run root checked to hold replies this run can use (see `open_earlier_run`)."""

    where: str  # its URL, redacted, for messages and the accounting
    fingerprint_hash: str
    store: ShardStore
    shards: list[ShardPlan]  # its shard plan: which shard holds which prompt-id range

    def journal_reused(
        self, store: ShardStore, shard_id: str, planned: list[PlannedRequest], flush_s: float
    ) -> int:
        """Journal into `shard_id` of `store` the earlier run's rows of the `planned` requests
        whose journal holds no ok outcome yet; returns how many. Idempotent: a resume that
        journaled them before writes nothing. The earlier shards are looked up when needed, so
        one committed after this stage prepared counts too, and one found damaged is skipped
        with a warning (its requests are generated here)."""
        if not planned:
            return 0
        lo = min(p.prompt_id for p in planned)
        hi = max(p.prompt_id for p in planned)
        sources = [s for s in self.shards if s.first_prompt_id <= hi and s.last_prompt_id >= lo]
        if not sources:
            return 0
        held = replay_journal(store, shard_id, retry_dead=False).ok
        wanted = [p for p in planned if p.request_id not in held]
        if not wanted:
            return 0
        rows = self._rows(sources, {p.prompt_id for p in wanted})
        reused = [
            (p, rows[(p.prompt_id, p.sample_index)])
            for p in wanted
            if (p.prompt_id, p.sample_index) in rows
        ]
        if not reused:
            return 0
        # Its own attempt each time (on an object store a journal attempt is numbered chunks,
        # which a second writer of the same attempt would overwrite); the name says where from.
        attempt = f"{REUSED_ATTEMPT_PREFIX}{self.fingerprint_hash}-{new_attempt_id()}"
        journal = JournalWriter(store.run, STAGE, shard_id, attempt, flush_s=flush_s)
        try:
            for plan, row in reused:
                journal.append(
                    {
                        "status": "ok",
                        "request_id": plan.request_id,
                        **{key: row[key] for key in COPIED},
                        "attempts": 0,  # nothing was sent for it here
                        "prompt_id": plan.prompt_id,
                        "sample_index": plan.sample_index,
                        "attempt": attempt,
                        "reused_from": self.where,
                        "reused_request_id": row["request_id"],
                    }
                )
        finally:
            journal.close()
        log.info(
            "shard %s: %d of %d requests reused from %s",
            shard_id,
            len(reused),
            len(planned),
            self.where,
        )
        return len(reused)

    def _rows(
        self, sources: list[ShardPlan], prompt_ids: set[str]
    ) -> dict[tuple[str, int], dict[str, Any]]:
        """(prompt_id, sample_index) -> committed row, over the earlier `sources` shards; their
        bytes are verified against their markers, as every reader of a committed shard does."""
        value_set = pa.array(sorted(prompt_ids), pa.string())
        found: dict[tuple[str, int], dict[str, Any]] = {}
        for shard in sources:
            marker = self.store.marker(shard.shard_id)
            if marker is None:  # not committed there (yet)
                continue
            try:
                table = self.store.read_rows(marker)
            except CorruptShard as e:
                log.warning("generate.reuse_from: %s; its requests are generated here instead", e)
                continue
            # Filtered in Arrow: a shard of long replies is large as Python objects.
            keep = pc.is_in(table.column("prompt_id"), value_set=value_set)
            for row in table.filter(keep).to_pylist():
                found[(row["prompt_id"], row["sample_index"])] = row
        return found


def open_earlier_run(
    url: str, storage_options: dict[str, Any] | None, fingerprint: dict[str, Any]
) -> EarlierRun:
    """The run root at `url`, checked against this run's `fingerprint` (its target and sampling
    must be equal) and for a committed generation shard. Raises ConfigError (not a run, nothing
    committed) or FingerprintMismatch (naming each differing field) and writes nothing."""
    where = redact_url(url)
    try:
        fs, path = url_to_fs(url, **(storage_options or {}))
        is_dir = fs.isdir(path)
    except Exception as e:  # filesystem drivers raise their own exception types
        raise _refused(where, f"cannot open it: {type(e).__name__}: {e}") from None
    if not is_dir:
        raise _refused(where, "no run folder there")
    run = RunFolder(url, storage_options)  # only now: a local RunFolder creates its folder
    try:
        recorded = run.read_json(RUN_JSON)
    except ValueError as e:
        raise _refused(where, f"its {RUN_JSON} is not valid JSON ({e})") from None
    if not isinstance(recorded, dict) or not {"fingerprint", "fingerprint_hash"} <= recorded.keys():
        raise _refused(where, f"no {RUN_JSON}: not a run root whose generation has started")
    earlier = {key: recorded["fingerprint"].get(key) for key in COMPARED}
    diffs = diff_fingerprints(earlier, {key: fingerprint.get(key) for key in COMPARED})
    if diffs:
        raise FingerprintMismatch(
            f"generate.reuse_from: {where} was generated with another target or sampling than "
            "this run, so its replies are not this run's; nothing was sent. Reuse a run of the "
            "same target and sampling, or unset generate.reuse_from. Differing fields (that run "
            "-> this one):\n  " + "\n  ".join(diffs)
        )
    store = ShardStore(run, STAGE)
    if not store.committed():
        raise _refused(
            where, f"no committed generation shard ({STAGE}/_SUCCESS/ is empty or missing)"
        )
    plan = run.read_json(SHARD_PLAN)
    if not plan or not plan.get("shards"):
        raise _refused(
            where, f"committed generation shards but no {SHARD_PLAN} to find their prompts by"
        )
    return EarlierRun(
        where,
        recorded["fingerprint_hash"],
        store,
        [ShardPlan(**s) for s in plan["shards"]],
    )
