"""Shard leases: one worker runs a shard at a time, and a dead worker's shards are taken over.

    <stage>/leases/<shard>.<epoch>.json   {"holder", "epoch", "ttl_s", "seq", "heartbeat_at",
                                           "released", "took_over"?}

Claiming a shard is the exclusive create of its next epoch's object (`RunFolder.create_exclusive`:
a hard link locally, If-None-Match on S3), so exactly one worker wins each epoch. The holder
heartbeats by rewriting its own epoch's object every `heartbeat_s`, from a background thread.

Expiry is judged from the store's modification time of that object, not from the time the
holder writes into it: a holder whose clock is off cannot make its lease look fresh or stale,
and the claimer only needs its own clock to roughly agree with the store's (NTP does that; the
TTL is minutes). The holder's `ttl_s` is written into the lease, so a claimer with another
config still waits the holder's promised interval.

A holder on this host whose process is gone cannot heartbeat again, so its lease is taken over
at once rather than after the TTL (a worker killed with -9 and restarted resumes its shards
straight away). The holder record names its host, boot, pid namespace, pid and the process's
start time; the lease counts as dead only when host, boot and pid namespace are this process's
own and the pid is gone or names a process started at another time (a reused pid). Holders
elsewhere are judged by the TTL alone.

A takeover creates epoch + 1 beside the old one (objects are never deleted, so every epoch is
created only after its predecessor was seen, and the highest epoch is the current one). A
holder learns it lost the shard when epoch + 1 exists: its heartbeat marks the lease lost and
the work stops before committing. The commit's exclusive marker still guards the race in
between, so a lease is about not duplicating work, never about correctness.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tasks.runfolder.folder import TMP_PREFIX, RunFolder, json_bytes

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """Another worker took this shard over (our heartbeats stopped for longer than the TTL)."""


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_started(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None
    where there is no /proc or no such process."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name may hold spaces or ')'
    return int(fields[19]) if len(fields) > 19 else None


def new_holder() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _pid_namespace(),
        "pid": os.getpid(),
        "started": process_started(os.getpid()),
        "id": uuid.uuid4().hex[:12],
    }


def holder_gone(holder: dict[str, Any] | None, here: dict[str, Any]) -> bool:
    """Whether `holder` is certainly dead: a process of this host (same boot, same pid
    namespace as `here`) that no longer runs, or whose pid another process now has."""
    if not holder or not here.get("boot_id") or not isinstance(holder.get("pid"), int):
        return False
    if any(holder.get(k) != here.get(k) for k in ("host", "boot_id", "pid_ns")):
        return False
    pid = holder["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, under another user
        pass
    started = holder.get("started")
    return started is not None and process_started(pid) not in (None, started)


def holder_label(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "?"
    return f"{holder.get('host', '?')}/{holder.get('pid', '?')}"


def _mtime(info: dict[str, Any]) -> float | None:
    stamp = info.get("mtime") or info.get("LastModified") or info.get("created")
    if stamp is None:
        return None
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


@dataclass(frozen=True)
class LeaseView:
    """The current (highest) epoch of one shard's lease, as seen at `seen_at`."""

    shard_id: str
    epoch: int
    record: dict[str, Any]
    heartbeat_age_s: float  # seen_at minus the store's mtime of the lease object
    ttl_s: float
    holder_gone: bool = False  # its holder is a dead process of this host (see holder_gone)

    @property
    def released(self) -> bool:
        return bool(self.record.get("released"))

    @property
    def expired(self) -> bool:
        return self.heartbeat_age_s > self.ttl_s

    @property
    def live(self) -> bool:
        return not self.released and not self.expired and not self.holder_gone

    @property
    def holder(self) -> dict[str, Any]:
        return self.record.get("holder") or {}

    def describe(self) -> str:
        who = holder_label(self.holder)
        if self.released:
            return f"released by {who} (epoch {self.epoch})"
        age = f"{self.heartbeat_age_s:.0f} s ago"
        if self.holder_gone:
            return f"lease of {who}: that process is gone, heartbeat {age} (epoch {self.epoch})"
        if self.expired:
            return f"lease of {who} expired, heartbeat {age} (epoch {self.epoch})"
        return f"leased by {who}, heartbeat {age} (epoch {self.epoch})"


class Lease:
    """One held epoch of one shard. `check()` raises LeaseLost once a takeover was seen."""

    def __init__(self, table: LeaseTable, shard_id: str, epoch: int, record: dict[str, Any]):
        self.table, self.shard_id, self.epoch = table, shard_id, epoch
        self.record = record
        self.lost = threading.Event()
        self.released = False
        self._lock = threading.Lock()

    @property
    def key(self) -> str:
        return self.table.key(self.shard_id, self.epoch)

    def check(self) -> None:
        """Cheap: raises if a heartbeat has already seen the takeover."""
        if self.lost.is_set():
            raise LeaseLost(
                f"shard {self.shard_id}: lease epoch {self.epoch} was taken over by another "
                f"worker; this attempt stops without committing"
            )

    def verify(self) -> None:
        """Asks the store now (one existence check): call it right before committing."""
        if self.table.run.exists(self.table.key(self.shard_id, self.epoch + 1)):
            self.lost.set()
        self.check()

    def renew(self) -> bool:
        """Rewrite our epoch's object (its mtime is the heartbeat); False once lost."""
        with self._lock:
            if self.released or self.lost.is_set():
                return False
            if self.table.run.exists(self.table.key(self.shard_id, self.epoch + 1)):
                log.warning("shard %s: lease epoch %d was taken over", self.shard_id, self.epoch)
                self.lost.set()
                return False
            self.record = {
                **self.record,
                "seq": self.record["seq"] + 1,
                "heartbeat_at": time.time(),
            }
            self.table.run.write_bytes_atomic(self.key, json_bytes(self.record))
            return True

    def release(self) -> None:
        """Mark the lease released so the next claimer need not wait for the TTL."""
        with self._lock:
            if self.released:
                return
            self.released = True
            if self.lost.is_set():
                return  # the epoch belongs to history now; the taker owns the shard
            self.record = {**self.record, "released": True, "released_at": time.time()}
            self.table.run.write_bytes_atomic(self.key, json_bytes(self.record))


class LeaseTable:
    """The leases of one stage, and this process's claims on them (one holder identity)."""

    def __init__(self, run: RunFolder, stage: str, ttl_s: float, heartbeat_s: float):
        if heartbeat_s >= ttl_s:
            raise ValueError(f"lease heartbeat_s ({heartbeat_s}) must be below ttl_s ({ttl_s})")
        self.run, self.stage = run, stage
        self.ttl_s, self.heartbeat_s = ttl_s, heartbeat_s
        self.holder = new_holder()
        self._held: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def dir(self) -> str:
        return f"{self.stage}/leases"

    def key(self, shard_id: str, epoch: int) -> str:
        return f"{self.dir}/{shard_id}.{epoch}.json"

    # ---- reading ------------------------------------------------------------------------------

    def scan(self, shard_ids: Iterable[str] | None = None) -> dict[str, LeaseView]:
        """shard_id -> its current lease, for every leased shard (or only `shard_ids`)."""
        return read_leases(self.run, self.stage, self.ttl_s, shard_ids, self.holder)

    def live_shards(self) -> set[str]:
        """Shards whose lease is held (not released, not expired) by anyone, this process included."""
        return {s for s, v in self.scan().items() if v.live}

    # ---- claiming -----------------------------------------------------------------------------

    def claim(self, shard_id: str) -> Lease | None:
        """The shard's lease for this process, or None while another worker holds it live."""
        with self._lock:
            held = self._held.get(shard_id)
            if held is not None and not held.lost.is_set() and not held.released:
                return held
        view = self.scan([shard_id]).get(shard_id)
        if view is not None and view.live:
            return None
        epoch = 0 if view is None else view.epoch + 1
        record: dict[str, Any] = {
            "shard_id": shard_id,
            "stage": self.stage,
            "epoch": epoch,
            "holder": self.holder,
            "ttl_s": self.ttl_s,
            "heartbeat_s": self.heartbeat_s,
            "seq": 0,
            "acquired_at": time.time(),
            "heartbeat_at": time.time(),
            "released": False,
        }
        if view is not None and not view.released:
            record["took_over"] = {
                "holder": view.holder,
                "epoch": view.epoch,
                "heartbeat_age_s": round(view.heartbeat_age_s, 3),
                "holder_gone": view.holder_gone,
            }
        if not self.run.create_exclusive(self.key(shard_id, epoch), json_bytes(record)):
            return None  # another claimer won this epoch
        if "took_over" in record:
            log.warning("shard %s: took over from %s", shard_id, view.describe() if view else "?")
        lease = Lease(self, shard_id, epoch, record)
        with self._lock:
            self._held[shard_id] = lease
            self._start_heartbeat()
        return lease

    def held(self, shard_id: str) -> Lease | None:
        with self._lock:
            return self._held.get(shard_id)

    def release(self, shard_id: str) -> None:
        with self._lock:
            lease = self._held.pop(shard_id, None)
        if lease is not None:
            lease.release()

    def close(self) -> None:
        """Stop heartbeating and release every lease still held."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            leases, self._held = list(self._held.values()), {}
        for lease in leases:
            try:
                lease.release()
            except Exception as e:  # the TTL frees it anyway
                log.warning("could not release lease of shard %s: %s", lease.shard_id, e)

    # ---- heartbeat ----------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._heartbeat_loop, daemon=True, name=f"{self.stage}-leases"
            )
            self._thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                leases = list(self._held.values())
            for lease in leases:
                try:
                    lease.renew()
                except Exception as e:  # a store hiccup: the next beat retries
                    log.warning("lease heartbeat for shard %s failed: %s", lease.shard_id, e)


def read_leases(
    run: RunFolder,
    stage: str,
    default_ttl_s: float,
    shard_ids: Iterable[str] | None = None,
    here: dict[str, Any] | None = None,
) -> dict[str, LeaseView]:
    """shard_id -> its current (highest-epoch) lease under `<stage>/leases`; read-only, so the
    status command can show who holds what. `default_ttl_s` judges records that lack one;
    `here` (a holder record of this process; by default a fresh one) judges whether a holder
    on this host is gone."""
    here = here or new_holder()
    wanted = None if shard_ids is None else set(shard_ids)
    full = run.path(f"{stage}/leases")
    run.fs.invalidate_cache(full)
    try:
        entries = run.fs.ls(full, detail=True)
    except FileNotFoundError:
        return {}
    now = time.time()
    top: dict[str, tuple[int, float | None]] = {}
    for entry in entries:
        shard_id, epoch = _parse(entry["name"].rstrip("/").rsplit("/", 1)[-1])
        if shard_id is None or (wanted is not None and shard_id not in wanted):
            continue
        if shard_id not in top or epoch > top[shard_id][0]:
            top[shard_id] = (epoch, _mtime(entry))
    views = {}
    for shard_id, (epoch, mtime) in top.items():
        try:
            record = json.loads(run.read_bytes(f"{stage}/leases/{shard_id}.{epoch}.json"))
        except (FileNotFoundError, ValueError):
            record = {}  # mid-rewrite on a store without atomic replace: judge by mtime alone
        age = max(now - mtime, 0.0) if mtime is not None else 0.0
        ttl = float(record.get("ttl_s") or default_ttl_s)
        gone = not record.get("released") and age <= ttl and holder_gone(record.get("holder"), here)
        views[shard_id] = LeaseView(shard_id, epoch, record, age, ttl, gone)
    return views


def _parse(name: str) -> tuple[str | None, int]:
    if name.startswith(TMP_PREFIX) or not name.endswith(".json"):
        return None, -1
    shard_id, _, epoch = name.removesuffix(".json").rpartition(".")
    if not shard_id or not epoch.isdigit():
        return None, -1
    return shard_id, int(epoch)
