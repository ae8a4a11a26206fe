"""Which shards this worker runs next, when several workers share one run root.

Every step re-reads the run folder (markers and leases): a shard is started here only once
this process holds its lease; shards leased by live workers elsewhere are waited on (their
marker will appear), and a shard whose lease expired (a worker killed mid-shard) is taken over
by claiming the next epoch. A shard that failed here is not retried by this scheduler (Prefect's
task retries already ran), so the loop always ends: every planned shard committed or failed.

Any stage with shard leases can be scheduled: it implements `LeasedStage`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from tasks.runfolder.leases import Lease, LeaseLost, LeaseTable, LeaseView

log = logging.getLogger(__name__)

DONE_STATUSES = ("committed", "skipped", "lost_race")
NOT_OURS_STATUSES = ("leased", "lease_lost")
T = TypeVar("T")


class LeasedStage(Protocol):
    def observe(self) -> tuple[dict[str, dict[str, Any]], dict[str, LeaseView]]:
        """(committed markers, current leases) of the stage's shards, read from the run folder."""
        ...

    def marker_done(self, shard_id: str, marker: dict[str, Any]) -> bool:
        """Whether this committed marker finishes the shard for this run (a stale or a
        to-be-retried marker does not)."""
        ...

    def claim(self, shard_id: str) -> bool:
        """Take the shard's lease for this process; False while another worker holds it."""
        ...

    def release(self, shard_id: str) -> None: ...


class ShardScheduler:
    def __init__(self, stage: LeasedStage, pending: list[str], max_running: int):
        self.stage, self.max_running = stage, max_running
        self.order = list(pending)
        self.todo = set(pending)
        self.running: set[str] = set()
        self.failed: dict[str, str] = {}
        self.waiting: dict[str, str] = {}  # shard -> lease description, leased elsewhere

    @property
    def done(self) -> bool:
        return not self.running and self.todo <= self.failed.keys()

    def step(self) -> list[str]:
        """Observe the run folder; claim up to the free slots. Returns the shards claimed
        (the caller starts them and reports back through `finished`)."""
        committed, views = self.stage.observe()
        for shard_id in list(self.todo - self.running):
            marker = committed.get(shard_id)
            if marker is not None and self.stage.marker_done(shard_id, marker):
                self.todo.discard(shard_id)
        self.waiting = {}
        claimed: list[str] = []
        for shard_id in self.order:
            if shard_id not in self.todo or shard_id in self.running or shard_id in self.failed:
                continue
            view = views.get(shard_id)
            if view is not None and view.live:
                self.waiting[shard_id] = view.describe()
                continue
            if len(self.running) >= self.max_running:
                continue
            if self.stage.claim(shard_id):
                self.running.add(shard_id)
                claimed.append(shard_id)
        return claimed

    def abandon(self, why: str) -> None:
        """Start nothing more: every shard not yet running counts as failed with `why` (the
        loop then ends as soon as the running ones do)."""
        for shard_id in self.todo - self.running - self.failed.keys():
            self.failed[shard_id] = f"not started: {why}"[:300]

    def finished(self, shard_id: str, result: dict[str, Any] | BaseException) -> None:
        """A started shard ended: its outcome summary, or the error its task raised."""
        self.running.discard(shard_id)
        self.stage.release(shard_id)
        if isinstance(result, BaseException):
            self.failed[shard_id] = f"{type(result).__name__}: {result}"[:300]
        elif result.get("status") in DONE_STATUSES:
            self.todo.discard(shard_id)
        elif result.get("status") not in NOT_OURS_STATUSES:
            raise ValueError(f"shard {shard_id}: unknown outcome status {result.get('status')!r}")


def run_under_lease(
    leases: LeaseTable,
    shard_id: str,
    work: Callable[[Lease], T],
    not_ours: Callable[[str], T],
) -> T:
    """Run `work` under the shard's lease: the one claimed before (kept afterwards, the caller
    releases it), else one claimed and released here. A shard leased by a live worker
    elsewhere, or taken over mid-run (LeaseLost), ends as `not_ours("leased")` /
    `not_ours("lease_lost")`, not as a failure."""
    lease = leases.held(shard_id)
    owned = lease is None
    if lease is None:
        lease = leases.claim(shard_id)
        if lease is None:
            return not_ours("leased")
    try:
        return work(lease)
    except LeaseLost as e:
        log.warning("%s", e)
        return not_ours("lease_lost")
    finally:
        if owned:
            leases.release(shard_id)


Report = Callable[[Any], None]


def drive_shards(
    scheduler: ShardScheduler,
    start: Callable[[str, Report], None],
    poll_s: float,
    on_wait: Callable[[dict[str, str]], None] | None = None,
    on_poll: Callable[[], None] | None = None,
    collect: Callable[[Any], dict[str, Any] | BaseException] = lambda r: r,
    fatal: Callable[[BaseException], bool] = lambda e: False,
) -> dict[str, BaseException | str]:
    """The one loop that drives shards, for every stage and executor. Each shard the scheduler
    claims goes to `start(shard_id, report)`, which runs it here or submits it elsewhere;
    `report(x)` (from any thread, before or after `start` returns) hands back what `collect`
    turns into the shard's outcome summary or the exception it raised. The loop wakes at the
    first shard to end or after `poll_s` (to re-read leases: an expired one is taken over
    within about one heartbeat), tells `on_wait` each new set of shards waited on elsewhere,
    and calls `on_poll` once per pass (progress, stall alerts). A failure `fatal` says no retry
    heals stops the loop from starting other shards. Returns the failures, shard -> the
    exception raised, else the scheduler's description."""
    ended: queue.Queue[tuple[str, Any]] = queue.Queue()
    errors: dict[str, BaseException] = {}
    waited_on: set[str] = set()

    def drain(timeout: float | None) -> int:
        n = 0
        with contextlib.suppress(queue.Empty):
            item = ended.get(timeout=timeout) if timeout else ended.get_nowait()
            while True:
                shard_id, raw = item
                result = collect(raw)
                if isinstance(result, BaseException):
                    log.warning("shard %s failed: %s", shard_id, result)
                    errors[shard_id] = result
                scheduler.finished(shard_id, result)
                if isinstance(result, BaseException) and fatal(result):
                    scheduler.abandon(f"shard {shard_id} failed with {type(result).__name__}")
                n += 1
                item = ended.get_nowait()
        return n

    while True:
        claimed = scheduler.step()
        for shard_id in claimed:
            try:
                start(shard_id, lambda raw, s=shard_id: ended.put((s, raw)))
            except Exception as e:  # recorded; the other shards still run
                ended.put((shard_id, e))
        done_now = drain(None)
        if scheduler.done:
            return {s: errors.get(s, text) for s, text in scheduler.failed.items()}
        if scheduler.running:
            drain(poll_s)
        elif not claimed and not done_now:  # every shard left is leased by a live worker elsewhere
            if scheduler.waiting.keys() != waited_on:
                waited_on = set(scheduler.waiting)
                if on_wait is not None:
                    on_wait(dict(scheduler.waiting))
            time.sleep(poll_s)
        if on_poll is not None:
            on_poll()


def run_one_at_a_time(
    scheduler: ShardScheduler,
    run_one: Callable[[str], dict[str, Any]],
    poll_s: float,
    on_wait: Callable[[dict[str, str]], None] | None = None,
) -> dict[str, str]:
    """`drive_shards` in this thread: each claimed shard runs with `run_one` (its outcome
    summary; an exception counts as the shard's failure). Returns the failures, shard -> error."""

    def start(shard_id: str, report: Report) -> None:
        try:
            report(run_one(shard_id))
        except Exception as e:
            report(e)

    drive_shards(scheduler, start, poll_s, on_wait)
    return dict(scheduler.failed)
