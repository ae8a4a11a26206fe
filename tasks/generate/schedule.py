"""Which shards this worker runs next, when several workers share one run root.

Every step re-reads the run folder (markers and leases): a shard is started here only once
this process holds its lease; shards leased by live workers elsewhere are waited on (their
marker will appear), and a shard whose lease expired (a worker killed mid-shard) is taken over
by claiming the next epoch. A shard that failed here is not retried by this scheduler (Prefect's
task retries already ran), so the loop always ends: every planned shard committed or failed.
"""

from __future__ import annotations

import logging
from typing import Any

from tasks.generate.stage import GenerateStage

log = logging.getLogger(__name__)

DONE_STATUSES = ("committed", "skipped", "lost_race")
NOT_OURS_STATUSES = ("leased", "lease_lost")


class ShardScheduler:
    def __init__(self, stage: GenerateStage, pending: list[str], max_running: int):
        self.stage, self.max_running = stage, max_running
        self.order = list(pending)
        self.todo = set(pending)
        self.running: set[str] = set()
        self.failed: dict[str, str] = {}
        self.waiting: dict[str, str] = {}  # shard -> lease description, leased elsewhere
        self._retry_dead = stage.cfg.generate.retry_dead
        # retry-dead reruns marked shards: only a newer marker than the one at start is done
        self._initial = {s: m.get("attempt") for s, m in stage.store.committed().items()}

    @property
    def done(self) -> bool:
        return not self.running and self.todo <= self.failed.keys()

    def step(self) -> list[str]:
        """Observe the run folder; claim up to the free slots. Returns the shards claimed
        (the caller starts them and reports back through `finished`)."""
        committed, views = self.stage.observe()
        for shard_id in list(self.todo - self.running):
            marker = committed.get(shard_id)
            if marker is not None and self._is_done(shard_id, marker):
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

    def _is_done(self, shard_id: str, marker: dict[str, Any]) -> bool:
        if not self._retry_dead or marker.get("dead", 0) == 0:
            return True
        return marker.get("attempt") != self._initial.get(shard_id)

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
