"""Which shards this worker runs next, when several workers share one run root.

Every step re-reads the run folder (markers and leases): a shard is started here only once
this process holds its lease; shards leased by live workers elsewhere are waited on (their
marker will appear), and a shard whose lease expired (a worker killed mid-shard) is taken over
by claiming the next epoch. A shard that failed here is not retried by this scheduler (Prefect's
task retries already ran), so the loop always ends: every planned shard committed or failed.

Any stage with shard leases can be scheduled: it implements `LeasedStage`.
"""

from __future__ import annotations

import logging
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


def run_one_at_a_time(
    scheduler: ShardScheduler,
    run_one: Callable[[str], dict[str, Any]],
    poll_s: float,
    on_wait: Callable[[dict[str, str]], None] | None = None,
) -> dict[str, str]:
    """Drive `scheduler` in this thread: run each claimed shard with `run_one` (its outcome
    summary; an exception counts as the shard's failure), and while every shard left is
    leased by a live worker elsewhere, re-read the run folder every `poll_s` so an expired
    lease is taken over. `on_wait` hears each new set of shards waited on. Returns the
    failures, shard -> error."""
    waited_on: set[str] = set()
    while True:
        claimed = scheduler.step()
        for shard_id in claimed:
            try:
                result: dict[str, Any] | BaseException = run_one(shard_id)
            except Exception as e:  # recorded; the other shards still run
                log.warning("shard %s failed: %s", shard_id, e)
                result = e
            scheduler.finished(shard_id, result)
        if scheduler.done:
            return scheduler.failed
        if not claimed:
            if scheduler.waiting.keys() != waited_on:
                waited_on = set(scheduler.waiting)
                if on_wait is not None:
                    on_wait(dict(scheduler.waiting))
            time.sleep(poll_s)
