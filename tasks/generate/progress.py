"""Generation progress: counts, token rates, a token-based ETA and a heartbeat, in progress.json.

The file is the stall signal that does not depend on a live process: the status command flags
a run whose heartbeat is older than `stall_after_s`. Shards found committed (or journaled) when
this process started count as done but never as throughput, so a resumed run's rate and ETA
describe this process only; so do requests reused from an earlier run (generate.reuse_from), which
are done without a request sent. All times are epoch seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tasks.engines.base import ServerHealth
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import GENERATE_PROGRESS

log = logging.getLogger(__name__)

RUN_STATES = ("running", "complete", "failed", "stopped")
RUNNING_DEAD = "in running shards"  # dead letters whose class their shard's marker will count


# ---- the arithmetic, as pure functions ------------------------------------------------------


def lifetime_rate(amount: float, started_at: float, now: float) -> float | None:
    """Mean rate since start; None before any time has passed."""
    elapsed = now - started_at
    return amount / elapsed if elapsed > 0 else None


def window_rate(
    amount_in_window: float, started_at: float, now: float, window_s: float
) -> float | None:
    """Rate over the trailing window; a run younger than the window divides by its age instead,
    so the first minutes are not underestimated."""
    span = min(window_s, now - started_at)
    return amount_in_window / span if span > 0 else None


def mean_completion_tokens(completion_tokens: int, finished_ok: int, default: float) -> float:
    """Mean output length of finished requests; `default` (max_new_tokens) before any finished."""
    return completion_tokens / finished_ok if finished_ok > 0 else float(default)


def remaining_tokens(total_requests: int, done_requests: int, mean_completion: float) -> float:
    return max(0, total_requests - done_requests) * mean_completion


def eta_seconds(remaining: float, tokens_per_s: float | None) -> float | None:
    """Seconds left at the given rate: 0 when nothing remains, None without a positive rate."""
    if remaining <= 0:
        return 0.0
    if not tokens_per_s or tokens_per_s <= 0:
        return None
    return remaining / tokens_per_s


def stalled_for(last_activity: float, now: float, stall_after_s: float) -> float | None:
    """Age of the last activity when it exceeds the bound, else None."""
    age = now - last_activity
    return age if age > stall_after_s else None


class RateWindow:
    """Tokens and requests per whole second, for the trailing `window_s` (at most that many
    buckets, whatever the request rate). A bucket counts while its start second lies inside
    (now - window_s, now]."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._buckets: deque[list[float]] = deque()  # [second, tokens, requests]

    def add(self, t: float, tokens: int, requests: int) -> None:
        second = float(int(t))
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += tokens
            self._buckets[-1][2] += requests
        else:
            self._buckets.append([second, float(tokens), float(requests)])

    def totals(self, now: float) -> tuple[float, float]:
        """(tokens, requests) of buckets inside (now - window_s, now]; older ones are dropped."""
        while self._buckets and self._buckets[0][0] <= now - self.window_s:
            self._buckets.popleft()
        return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets)


def _sent(sent: int | None, requests: int) -> int:
    return requests if sent is None else sent


def first_started_at(previous: Mapping[str, Any] | None) -> float | None:
    """When generation of the run root began, from the progress.json an earlier process left:
    its own record of the first start, else (files from before that was kept) its start if it
    generated anything. Each process starts from this, so the first start survives resumes."""
    if not previous:
        return None
    if previous.get("first_started_at") is not None:
        return float(previous["first_started_at"])
    if (previous.get("requests") or {}).get("done_this_run") and previous.get("started_at"):
        return float(previous["started_at"])
    return None


# ---- the tracker -----------------------------------------------------------------------------


@dataclass
class Counts:
    requests: int = 0
    dead: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sent: int = 0  # requests sent to the engine for them, retries included
    reused: int = 0  # of `requests`, copied from an earlier run: none of them sent

    def add(self, other: Counts) -> None:
        self.requests += other.requests
        self.dead += other.dead
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.sent += other.sent
        self.reused += other.reused


@dataclass(frozen=True)
class ShardDone:
    """What one shard has finished that this process did not generate, as its marker or its
    journals record it: done, but never part of this process's rate. The generate stage builds
    one (`from_marker`, or from a journal replay) and hands it to `mark_committed`,
    `note_committed_elsewhere` or `mark_resumed`."""

    requests: int  # finished requests, dead letters included
    prompt_tokens: int
    completion_tokens: int
    dead: int = 0  # of `requests`, the dead letters
    # Requests sent to the engine for them, retries included; None: one each (markers from
    # before sends were counted).
    sent: int | None = None
    reused: int = 0  # of `requests`, copied from an earlier run (generate.reuse_from): none sent
    # The dead letters by error class, as the marker counts them; None: not known (a journal
    # replay, or a marker from before the count).
    dead_classes: Mapping[str, int] | None = None

    @classmethod
    def from_marker(cls, marker: Mapping[str, Any]) -> ShardDone:
        """A committed generation shard's counts, as its marker records them."""
        return cls(
            marker["rows"] + marker["dead"],
            marker.get("prompt_tokens", 0),
            marker.get("completion_tokens", 0),
            dead=marker["dead"],
            sent=marker.get("requests_sent"),
            reused=marker.get("reused", 0),
            dead_classes=marker.get("dead_classes"),
        )

    def counts(self) -> Counts:
        sent = _sent(self.sent, self.requests)
        return Counts(
            self.requests, self.dead, self.prompt_tokens, self.completion_tokens, sent, self.reused
        )


def per_request(sent: int, done: int) -> float | None:
    """Requests sent per finished request (1.0: nothing sent twice); None before any finished.
    `done` leaves reused requests out: nothing was sent for them."""
    return sent / done if done > 0 else None


@dataclass
class _Shard:
    planned: int
    state: str = "pending"
    before: Counts | None = None  # done before this process touched the shard
    now: Counts | None = None  # done by this process since the last mark
    info: dict[str, Any] | None = None
    dead_classes: Mapping[str, int] | None = None  # a committed shard's, from its marker

    def done(self) -> Counts:
        total = Counts()
        total.add(self.before or Counts())
        total.add(self.now or Counts())
        return total


def _dead_classes(shards: Iterable[_Shard]) -> dict[str, int]:
    """Dead letters by error class over the committed shards whose markers count them; those of
    shards not yet committed (a class is counted at commit) as `in running shards`."""
    out: dict[str, int] = {}
    for shard in shards:
        if shard.dead_classes is not None:
            for name, n in shard.dead_classes.items():
                out[name] = out.get(name, 0) + int(n)
        elif shard.done().dead:
            out[RUNNING_DEAD] = out.get(RUNNING_DEAD, 0) + shard.done().dead
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


class ProgressTracker:
    """Thread-safe progress of one generate stage; `write()` publishes it to the run folder."""

    def __init__(
        self,
        run: RunFolder,
        shards: Mapping[str, Mapping[str, Any]],
        max_new_tokens: int,
        stall_after_s: float,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        window_s: float = 300.0,
        first_started_at: float | None = None,
        reused_from: str | None = None,
    ):
        """`first_started_at`: when generation of this run root began, as an earlier process
        recorded it (see `first_started_at`); the status of a finished run measures its
        duration from there. `reused_from`: the earlier run generate.reuse_from names."""
        self.run = run
        self.reused_from = reused_from
        self.max_new_tokens = max_new_tokens
        self.stall_after_s = stall_after_s
        self.interval_s = interval_s
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._shards: dict[str, _Shard] = {}
        for shard_id, spec in shards.items():
            if "requests" not in spec:
                raise ValueError(f"shard {shard_id!r}: plan entry has no 'requests' count")
            self._shards[shard_id] = _Shard(planned=int(spec["requests"]))
        self._window = RateWindow(window_s)
        self._generated = Counts()  # by this process only: the lifetime rate
        self.started_at = clock()
        self.first_started_at = min(first_started_at or self.started_at, self.started_at)
        self._heartbeat_at = self.started_at
        self._last_progress_at: float | None = None
        self._last_write_at: float | None = None
        self._state = "running"
        self._servers: list[dict[str, Any]] = []

    def _shard(self, shard_id: str) -> _Shard:
        try:
            return self._shards[shard_id]
        except KeyError:
            raise ValueError(
                f"shard {shard_id!r} is not in the plan this tracker was given"
            ) from None

    def mark_committed(self, shard_id: str, done: ShardDone) -> None:
        """A shard committed before this process started: done, but not part of the rate."""
        with self._lock:
            shard = self._shard(shard_id)
            shard.before = done.counts()
            shard.now = None
            shard.state = "committed"
            shard.dead_classes = done.dead_classes

    def note_committed_elsewhere(self, shard_id: str, done: ShardDone) -> bool:
        """A shard another worker committed while this process ran: done, not part of this
        process's rate, but activity for the stall check. False when already committed."""
        with self._lock:
            shard = self._shard(shard_id)
            # Also this process's own commits: the marker is where their dead letters' classes are.
            shard.dead_classes = done.dead_classes
            if shard.state == "committed":
                return False
            shard.before = done.counts()
            shard.now = None
            shard.state = "committed"
            shard.info = None
            self._last_progress_at = self.clock()
            return True

    def mark_resumed(self, shard_id: str, done: ShardDone) -> None:
        """Requests a shard attempt recovered from its journal (some perhaps journaled from an
        earlier run, generate.reuse_from): done, not part of the rate.

        Replaces what was counted for the shard so far, so a retried attempt that replays
        results recorded earlier by this process does not count them twice.
        """
        with self._lock:
            shard = self._shard(shard_id)
            shard.before = done.counts()
            shard.now = None

    def shard_state(self, shard_id: str, state: str, **info: Any) -> None:
        """pending | running | committed | failed | dead-heavy ...; `info` is shown beside it."""
        with self._lock:
            shard = self._shard(shard_id)
            shard.state = state
            if info:
                shard.info = {**(shard.info or {}), **info}

    def record(
        self,
        shard_id: str,
        requests: int,
        prompt_tokens: int,
        completion_tokens: int,
        dead: int = 0,
        sent: int | None = None,
    ) -> None:
        """Requests finished by this process (`dead` of them as dead letters), after `sent`
        requests to the engine (default: one each)."""
        now = self.clock()
        with self._lock:
            shard = self._shard(shard_id)
            counts = Counts(requests, dead, prompt_tokens, completion_tokens, _sent(sent, requests))
            if shard.now is None:
                shard.now = Counts()
            shard.now.add(counts)
            self._generated.add(counts)
            self._window.add(now, completion_tokens, requests)
            self._heartbeat_at = self._last_progress_at = now

    def set_server_health(self, servers: Iterable[ServerHealth]) -> None:
        with self._lock:
            self._servers = [asdict(s) for s in servers]

    def set_state(self, state: str) -> None:
        if state not in RUN_STATES:
            raise ValueError(f"run state must be one of {RUN_STATES}, got {state!r}")
        with self._lock:
            self._state = state

    def stalled_for(self) -> float | None:
        """Seconds without a finished request, when over `stall_after_s` (for in-process alerts)."""
        with self._lock:
            last = self._last_progress_at or self.started_at
            return (
                stalled_for(last, self.clock(), self.stall_after_s)
                if self._state == "running"
                else None
            )

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot(self.clock())

    def _snapshot(self, now: float) -> dict[str, Any]:
        totals, shards, state_counts = Counts(), {}, {}
        total_requests = 0
        for shard_id, shard in self._shards.items():
            done = shard.done()
            totals.add(done)
            total_requests += shard.planned
            state_counts[shard.state] = state_counts.get(shard.state, 0) + 1
            # info from the caller (e.g. the marker's rows/dead at commit) beats our own count
            shards[shard_id] = {
                "state": shard.state,
                "requests": shard.planned,
                "done": done.requests,
                "dead": done.dead,
                "completion_tokens": done.completion_tokens,
                **(shard.info or {}),
            }
        window_tokens, window_requests = self._window.totals(now)
        window_tps = window_rate(window_tokens, self.started_at, now, self.window_s)
        mean = mean_completion_tokens(
            totals.completion_tokens, totals.requests - totals.dead, self.max_new_tokens
        )
        remaining = remaining_tokens(total_requests, totals.requests, mean)
        eta = eta_seconds(remaining, window_tps)
        return {
            "updated_at": now,
            "heartbeat_at": self._heartbeat_at,
            "last_progress_at": self._last_progress_at,
            "started_at": self.started_at,
            "first_started_at": self.first_started_at,
            "stall_after_s": self.stall_after_s,
            "state": self._state,
            "requests": {
                "done": totals.requests,
                "total": total_requests,
                "dead": totals.dead,
                "done_this_run": self._generated.requests,
                "sent": totals.sent,
                "sent_per_request": per_request(totals.sent, totals.requests - totals.reused),
                "sent_this_run": self._generated.sent,
            },
            # done without a request: copied from the earlier run generate.reuse_from names
            "reused": {"requests": totals.reused, "from": self.reused_from},
            "tokens": {
                "prompt_done": totals.prompt_tokens,
                "completion_done": totals.completion_tokens,
                "completion_total_estimate": round(totals.completion_tokens + remaining),
                "completion_this_run": self._generated.completion_tokens,
                "mean_completion_per_request": mean,
            },
            "rate": {
                "lifetime_tokens_per_s": lifetime_rate(
                    self._generated.completion_tokens, self.started_at, now
                ),
                "window_tokens_per_s": window_tps,
                "window_s": self.window_s,
                "requests_per_s": window_rate(window_requests, self.started_at, now, self.window_s),
            },
            "eta_s": eta,
            "eta_at": None if eta is None else now + eta,
            "percent": 100.0 * totals.requests / total_requests if total_requests else 100.0,
            "shard_counts": state_counts,
            "dead_classes": _dead_classes(self._shards.values()),
            "shards": shards,
            "servers": list(self._servers),
        }

    def write(self) -> None:
        """Publish progress.json now (atomic; the heartbeat moves with every write)."""
        with self._write_lock:
            with self._lock:
                now = self.clock()
                self._heartbeat_at = now
                self._last_write_at = now
                body = self._snapshot(now)
            self.run.write_json_atomic(GENERATE_PROGRESS, body)

    def maybe_write(self) -> bool:
        """Write when `interval_s` has passed since the last write. A failed write is a
        warning, not an error: the stale heartbeat it leaves is itself the signal."""
        with self._lock:
            due = (
                self._last_write_at is None or self.clock() - self._last_write_at >= self.interval_s
            )
        if not due:
            return False
        try:
            self.write()
        except Exception as e:
            log.warning("could not write %s under %s: %s", GENERATE_PROGRESS, self.run.url, e)
            return False
        return True
