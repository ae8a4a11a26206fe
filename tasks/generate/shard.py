"""One generation shard: replay its journal, run what is left, commit exactly once.

Exactly-once per request_id comes from three things: keys are content hashes, every outcome is
journaled before it counts, and a shard becomes visible only through its marker. A rerun of a
killed shard therefore resends only the requests its journals lack.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tasks.engines.base import (
    Engine,
    GenerationRequest,
    GenerationResult,
    Outcome,
    SamplingParams,
)
from tasks.generate.failures import ShardFailed, dead_fraction_failure
from tasks.generate.plan import PlannedRequest
from tasks.generate.rows import DEAD_SCHEMA, ROW_SCHEMA, is_reused, quality_flags, to_table
from tasks.runfolder import (
    CorruptShard,
    JournalWriter,
    Lease,
    ShardCommit,
    ShardStore,
    new_attempt_id,
    read_journal,
)
from tasks.runfolder.shards import redo_hint

log = logging.getLogger(__name__)
STAGE = "generate"


@dataclass
class ShardOutcome:
    shard_id: str
    status: str  # "committed" | "skipped" | "lost_race"; GenerateStage adds "leased" | "lease_lost" (runfolder/schedule.py: DONE_STATUSES, NOT_OURS_STATUSES)
    rows: int
    dead: int
    new_requests: int
    replayed: int
    torn_lines: int
    marker: dict[str, Any]
    sent: int = 0  # requests sent to the engine for this shard, over every journaled attempt
    reused: int = 0  # rows copied from an earlier run (generate.reuse_from), none of them sent


def sends(record: dict[str, Any]) -> int:
    """Requests sent to the engine for one journaled outcome (retries included); 1 for
    records journaled before outcomes carried their attempts, 0 for a row reused from an
    earlier run (generate.reuse_from)."""
    attempts = record.get("attempts")
    return 1 if attempts is None else int(attempts)


@dataclass
class Replay:
    ok: dict[str, dict]
    dead: dict[str, dict]
    torn: int
    sent: int  # over every record, superseded ones included: each was sent


def replay_journal(store: ShardStore, shard_id: str, retry_dead: bool) -> Replay:
    """Outcomes from every journaled attempt; a success anywhere beats a dead letter."""
    replay = read_journal(store.run, store.stage, shard_id)  # the store's stage: generation's, or the synthesis'
    ok: dict[str, dict] = {}
    dead: dict[str, dict] = {}
    sent = 0
    for rec in replay.records:
        rid = rec.get("request_id")
        sent += sends(rec)
        if rec.get("status") == "ok":
            ok.setdefault(rid, rec)
        elif rec.get("status") == "dead" and not retry_dead:
            dead[rid] = rec
    for rid in ok:
        dead.pop(rid, None)
    return Replay(ok, dead, replay.torn_lines, sent)


def replay_outcomes(
    store: ShardStore, shard_id: str, retry_dead: bool
) -> tuple[dict[str, dict], dict[str, dict], int]:
    """(ok, dead, torn) from every journaled attempt (see replay_journal)."""
    r = replay_journal(store, shard_id, retry_dead)
    return r.ok, r.dead, r.torn


@dataclass(frozen=True)
class ShardJob:
    """One generation shard to run: where it commits, what it plans, and what a committed copy
    lacks. The generate stage builds one per shard attempt."""

    store: ShardStore  # the generate stage's shards: markers, journals, commits
    shard_id: str
    planned: list[PlannedRequest]  # every request of the shard, in plan order
    fp_hash: str  # the run's fingerprint hash, recorded in the marker
    # What is wrong with the committed shard's files (ShardStore.damaged): rebuilds a marked
    # shard from its journals and commits it again; None for a shard to run as marked.
    damage: str | None = None
    # prompt_id -> domain, for the marker's per-domain counts (replies cut at their cap); None:
    # no per-domain counts.
    domains: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Sender:
    """How a shard's pending requests go to the engine and how its answers are read."""

    render_ids: Callable[[list[str]], list[list[int]]]  # prompt ids -> their token ids, in order
    engine: Engine
    sampling: SamplingParams
    # The text of a result that came back as ids only (an SGLang server started with
    # --skip-tokenizer-init), so rows and quality flags read the real text; None: no decoding.
    detokenize: Callable[[list[int]], str] | None = None
    # A prompt's own sampling (a domain's reply cap, sampling.max_new_tokens_by_domain), by
    # prompt id; None: `sampling` for every one.
    sampling_of: Callable[[str], SamplingParams] | None = None


@dataclass(frozen=True)
class ShardRules:
    """The generate section's rules for one shard attempt (generate.* of the config)."""

    max_dead_fraction: float  # more dead letters than this fraction of the plan: ShardFailed
    journal_flush_s: float = 1.0  # the journal's flush interval
    retry_dead: bool = False  # a marked shard with dead letters runs them again


@dataclass(frozen=True)
class ShardHooks:
    """What the caller (the stage's progress) hears of an attempt as it runs."""

    on_outcome: Callable[[Outcome], None] | None = None  # each outcome, once journaled
    # The outcomes known before anything is sent (ok, dead, requests sent for them): from the
    # journals, plus the committed rows a retry-dead attempt keeps.
    on_replay: Callable[[dict[str, dict], dict[str, dict], int], None] | None = None


def _check_rebuildable(job: ShardJob) -> None:
    shard_id, planned, damage = job.shard_id, job.planned, job.damage
    full = replay_journal(job.store, shard_id, retry_dead=False)
    missing = [p for p in planned if p.request_id not in full.ok and p.request_id not in full.dead]
    if missing:
        raise CorruptShard(
            f"shard {shard_id}: {damage}, and its journal holds {len(planned) - len(missing)} of "
            f"{len(planned)} outcomes, so it cannot be rebuilt without sending {len(missing)} "
            f"requests again; nothing was sent. Fix: restore the file, or "
            f"{redo_hint(job.store.marker_key(shard_id))} (those requests are generated again)"
        )
    log.warning("shard %s: %s; rebuilding it from its journal", shard_id, damage)


def run_shard(
    job: ShardJob,
    sender: Sender,
    rules: ShardRules,
    hooks: ShardHooks | None = None,
    lease: Lease | None = None,
) -> ShardOutcome:
    """Generate the requests of one shard that no journal or marker already holds.

    A damaged marked shard (`job.damage`) is rebuilt from its journals and committed again;
    one whose journals lack outcomes is refused (CorruptShard, naming the fix) before anything
    is sent, since it was generated once already.

    With a `lease`, the attempt stops (LeaseLost) as soon as a takeover is seen: at the next
    outcome, and for certain right before the commit."""
    hooks = hooks or ShardHooks()
    marker = job.store.marker(job.shard_id)
    if marker is not None and not _runs_again(job, marker, rules):
        return _skipped(job.shard_id, marker)
    known = _known_outcomes(job, marker, rules, hooks)
    ok, dead = known.ok, known.dead
    pending = [p for p in job.planned if p.request_id not in ok and p.request_id not in dead]
    attempt = new_attempt_id()
    log.info(
        "shard %s: %d planned, %d replayed ok, %d dead, %d to run (attempt %s)",
        job.shard_id, len(job.planned), len(ok), len(dead), len(pending), attempt,
    )  # fmt: skip
    sent = known.sent
    if pending:
        ok_new, dead_new = _generate(
            job, sender, attempt, pending, rules.journal_flush_s, hooks.on_outcome, lease
        )
        ok.update(ok_new)
        dead.update(dead_new)
        sent += sum(sends(r) for r in (*ok_new.values(), *dead_new.values()))
    rows, dead_table = _tables(job, ok, dead, rules.max_dead_fraction)
    reused = sum(is_reused(ok[p.request_id]) for p in job.planned if p.request_id in ok)
    if lease is not None:
        lease.verify()
    extra = _marker_fields(rows, dead_table, sent, reused, job.domains)
    planned_keys = [p.request_id for p in job.planned]
    replace = marker is not None  # a rebuild or a retry of dead letters
    shard = ShardCommit(
        job.shard_id, attempt, job.fp_hash, planned_keys, dead_table, extra=extra, replace=replace
    )
    result = job.store.commit(rows, shard)
    status = "committed" if result.won else "lost_race"
    return ShardOutcome(
        job.shard_id, status, rows.num_rows, dead_table.num_rows, len(pending),
        len(job.planned) - len(pending), known.torn, result.marker, sent, reused,
    )  # fmt: skip


def _runs_again(job: ShardJob, marker: dict[str, Any], rules: ShardRules) -> bool:
    """Whether a marked shard runs again: its files are damaged, or its dead letters retried."""
    return job.damage is not None or (rules.retry_dead and marker.get("dead", 0) > 0)


def _skipped(shard_id: str, marker: dict[str, Any]) -> ShardOutcome:
    """A shard committed already, as its marker records it."""
    sent = marker.get("requests_sent", marker["rows"] + marker["dead"])
    reused = marker.get("reused", 0)
    return ShardOutcome(
        shard_id, "skipped", marker["rows"], marker["dead"], 0, 0, 0, marker, sent, reused
    )


def _known_outcomes(
    job: ShardJob, marker: dict[str, Any] | None, rules: ShardRules, hooks: ShardHooks
) -> Replay:
    """The outcomes known before anything is sent: every journaled attempt's, plus the
    committed rows a retry-dead attempt keeps (its dead keys alone run again)."""
    committed_rows: dict[str, dict] = {}
    if marker is not None and job.damage is not None:
        _check_rebuildable(job)
    elif marker is not None:  # retry-dead: keep the committed rows, rerun only the dead keys.
        committed_rows = {r["request_id"]: r for r in job.store.read_rows(marker).to_pylist()}
    replay = replay_journal(job.store, job.shard_id, rules.retry_dead)
    replay.ok.update(committed_rows)
    if hooks.on_replay is not None and (replay.ok or replay.dead):
        hooks.on_replay(replay.ok, replay.dead, replay.sent)
    return replay


def _tables(
    job: ShardJob, ok: dict[str, dict], dead: dict[str, dict], max_dead_fraction: float
) -> tuple[pa.Table, pa.Table]:
    """(rows, dead letters) in plan order; ShardFailed when too many are dead to commit."""
    planned = job.planned
    rows = to_table([ok[p.request_id] for p in planned if p.request_id in ok], ROW_SCHEMA)
    dead_table = to_table(
        [dead[p.request_id] for p in planned if p.request_id in dead], DEAD_SCHEMA
    )
    if planned and dead_table.num_rows / len(planned) > max_dead_fraction:
        raise dead_fraction_failure(job.shard_id, len(planned), dead_table, max_dead_fraction)
    return rows, dead_table


def _by_domain(rows: pa.Table, domains: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Per domain: rows committed, and how many of them stopped at their reply cap."""
    out: dict[str, dict[str, int]] = {}
    for prompt_id, reason in zip(rows.column("prompt_id").to_pylist(), rows.column("finish_reason").to_pylist(),
                                 strict=True):  # fmt: skip
        counts = out.setdefault(domains.get(prompt_id, "?"), {"rows": 0, "finish_length": 0})
        counts["rows"] += 1
        counts["finish_length"] += reason == "length"
    return dict(sorted(out.items()))


def _marker_fields(
    rows: pa.Table, dead_table: pa.Table, sent: int, reused: int, domains: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Generation's own fields of the shard's marker."""
    by_domain = {} if domains is None else {"by_domain": _by_domain(rows, domains)}
    return {
        **by_domain,
        "prompt_tokens": sum(rows.column("prompt_tokens").to_pylist()),
        "completion_tokens": sum(rows.column("completion_tokens").to_pylist()),
        "quality": quality_flags(rows),
        "dead_classes": dict(Counter(dead_table.column("error_class").to_pylist())),
        # requests sent per generated request = requests_sent / (rows + dead - reused); 1.0:
        # none twice
        "requests_sent": sent,
        # rows copied from an earlier run (generate.reuse_from): done, but never sent
        "reused": reused,
        # committed rows per server, so a finished run can say who generated what
        "servers": dict(Counter(rows.column("server").to_pylist())),
    }


def _generate(
    job: ShardJob,
    sender: Sender,
    attempt: str,
    pending: list[PlannedRequest],
    journal_flush_s: float,
    on_outcome: Callable[[Outcome], None] | None,
    lease: Lease | None,
) -> tuple[dict[str, dict], dict[str, dict]]:
    ok: dict[str, dict] = {}
    dead: dict[str, dict] = {}
    lock = threading.Lock()
    by_rid = {p.request_id: p for p in job.planned}
    journal = JournalWriter(job.store.run, job.store.stage, job.shard_id, attempt, flush_s=journal_flush_s)
    engine, detokenize = sender.engine, sender.detokenize

    def sink(outcome: Outcome) -> None:
        plan = by_rid[outcome.request_id]
        record = outcome.to_record()
        record.update(prompt_id=plan.prompt_id, sample_index=plan.sample_index, attempt=attempt)
        if isinstance(outcome, GenerationResult):
            record["engine"] = engine.name
            if not record.get("text") and outcome.output_ids and detokenize is not None:
                record["text"] = detokenize(list(outcome.output_ids))
        journal.append(record)
        with lock:
            (ok if isinstance(outcome, GenerationResult) else dead)[outcome.request_id] = record
        if on_outcome is not None:
            on_outcome(outcome)
        if lease is not None:
            lease.check()  # journaled first: the taker's replay can still use this result

    rendered = sender.render_ids([p.prompt_id for p in pending])
    sampling_of = sender.sampling_of or (lambda _prompt_id: sender.sampling)
    requests = [
        GenerationRequest(p.request_id, p.prompt_id, p.sample_index, tuple(ids), sampling_of(p.prompt_id))
        for p, ids in zip(pending, rendered, strict=True)
    ]
    try:
        engine.generate(requests, sink)
    finally:
        journal.close()
    missing = [p.request_id for p in pending if p.request_id not in ok and p.request_id not in dead]
    if missing:
        raise ShardFailed(
            f"shard {job.shard_id}: engine returned without an outcome for {len(missing)} requests"
        )
    return ok, dead
