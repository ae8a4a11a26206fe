"""Shard leases on a local run root and on moto's S3 server, cleanup that spares leased shards,
and the issue's test: two CLI workers on one run root, one kill -9'd mid-shard."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

from tasks.runfolder import LeaseLost, LeaseTable, RunFolder, ShardCommit, ShardStore
from tasks.runfolder.folder import TMP_PREFIX, json_bytes
from tests.prefect_support import prefect_server
from tests.run_support import ROOT, assert_exactly_once, cli_env, start_cli, write_params
from tests.s3_support import moto_s3


@pytest.fixture(params=["local", "s3"])
def run(request, tmp_path, monkeypatch):
    if request.param == "local":
        yield RunFolder(str(tmp_path / "run"))
        return
    with moto_s3(monkeypatch) as s3:
        yield RunFolder(f"s3://{s3['bucket']}/runs/leases", s3["storage_options"])


def _until(predicate, what: str, limit_s: float = 60.0) -> None:
    deadline = time.time() + limit_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


# TTLs many heartbeats long: a loaded 2-core machine can stall a heartbeat thread or the test
# for a second or more, which must neither expire a live lease nor outlast a "still live" one.
TTL_LIVE_S = 3.0


def test_one_claimer_wins_each_epoch_and_heartbeats_keep_it(run):
    tables = [LeaseTable(run, "generate", ttl_s=TTL_LIVE_S, heartbeat_s=0.2) for _ in range(6)]
    won: list[LeaseTable] = []
    barrier = threading.Barrier(len(tables))

    def claim(table: LeaseTable) -> None:
        barrier.wait()
        if table.claim("s1") is not None:
            won.append(table)

    threads = [threading.Thread(target=claim, args=(t,)) for t in tables]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    holder, other = won[0], next(t for t in tables if t is not won[0])
    assert run.listdir("generate/leases") == ["s1.0.json"]
    # Past the TTL the lease is still live: the heartbeat moved its mtime.
    acquired = holder.held("s1").record["acquired_at"]
    _until(lambda: time.time() - acquired > TTL_LIVE_S + 0.5, "the TTL to pass")
    view = other.scan()["s1"]
    assert view.live and view.record["seq"] >= 3, view
    assert view.holder == holder.holder
    assert other.claim("s1") is None
    assert other.live_shards() == {"s1"}
    # A released lease is claimable at once, as the next epoch, and is no takeover.
    holder.release("s1")
    assert not other.scan()["s1"].live
    lease = other.claim("s1")
    assert lease is not None and lease.epoch == 1 and "took_over" not in lease.record
    for table in tables:
        table.close()
    assert other.scan()["s1"].released


def test_expired_lease_is_taken_over_and_the_old_holder_learns_it(run):
    # A worker that died right after claiming: its lease object stops being rewritten.
    dead_holder = {"host": "gone", "pid": 4242, "id": "dead00000000"}
    dead = {"holder": dead_holder, "epoch": 0, "ttl_s": TTL_LIVE_S, "seq": 0, "released": False}
    assert run.create_exclusive("generate/leases/s7.0.json", json_bytes(dead))
    taker = LeaseTable(run, "generate", ttl_s=30.0, heartbeat_s=0.2)
    assert taker.claim("s7") is None  # still inside the dead holder's TTL (from its record)
    _until(lambda: taker.scan()["s7"].expired, "the dead worker's lease to expire")
    lease = taker.claim("s7")
    assert lease is not None and lease.epoch == 1
    assert lease.record["took_over"]["holder"] == dead_holder
    assert lease.record["took_over"]["heartbeat_age_s"] > TTL_LIVE_S

    # A live holder whose shard is taken over anyway (it was frozen past its TTL) stops.
    victim = LeaseTable(run, "generate", ttl_s=30.0, heartbeat_s=0.2)
    held = victim.claim("s8")
    assert held is not None
    held.check()
    stolen = {"holder": taker.holder, "epoch": 1, "ttl_s": 30.0, "seq": 0, "released": False}
    assert run.create_exclusive("generate/leases/s8.1.json", json_bytes(stolen))
    with pytest.raises(LeaseLost, match="shard s8: lease epoch 0 was taken over"):
        held.verify()  # asks the store: no heartbeat needed
    other = victim.claim("s9")
    assert other is not None
    assert run.create_exclusive("generate/leases/s9.1.json", json_bytes(stolen))
    _until(other.lost.is_set, "the heartbeat to notice the takeover")
    with pytest.raises(LeaseLost):
        other.check()
    victim.close()  # a lost lease is not marked released: it belongs to history
    assert not run.read_json("generate/leases/s9.0.json")["released"]
    assert taker.scan()["s9"].epoch == 1
    taker.close()


def test_a_lease_whose_holder_died_on_this_host_is_taken_over_at_once(run, tmp_path):
    """A holder on this host whose process is gone (or whose pid now names another process)
    cannot heartbeat again: its lease is taken over at once, not after its TTL. One on
    another host, which this host cannot look into, keeps its lease until the TTL."""
    ttl = 120.0
    # A real holder: a child claims s1 and dies without releasing it.
    child = tmp_path / "holder.py"
    child.write_text(
        "import os, sys\n"
        "from tasks.runfolder import LeaseTable, RunFolder\n"
        f"run = RunFolder({run.url!r}, {run.storage_options!r})\n"
        f"assert LeaseTable(run, 'generate', {ttl}, 40.0).claim('s1') is not None\n"
        "os._exit(0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.run([sys.executable, str(child)], env=env, cwd=ROOT, check=True)
    assert holder.returncode == 0
    reused = LeaseTable(run, "generate", ttl, 40.0)  # our pid, another process's start time
    reused.holder = {**reused.holder, "started": reused.holder["started"] + 1}
    elsewhere = LeaseTable(run, "generate", ttl, 40.0)
    elsewhere.holder = {**elsewhere.holder, "host": "another-host"}
    alive = LeaseTable(run, "generate", ttl, 40.0)  # this very process: alive
    for table, shard in ((reused, "s2"), (elsewhere, "s3"), (alive, "s4")):
        assert table.claim(shard) is not None
        table._stop.set()  # no heartbeats needed: the TTL is far away

    taker = LeaseTable(run, "generate", ttl, 40.0)
    views = taker.scan()
    assert [views[s].live for s in ("s1", "s2", "s3", "s4")] == [False, False, True, True]
    assert "process is gone" in views["s1"].describe()
    lease = taker.claim("s1")
    assert lease is not None and lease.epoch == 1
    assert lease.record["took_over"]["holder_gone"] is True
    assert lease.record["took_over"]["heartbeat_age_s"] < ttl
    assert taker.claim("s2") is not None
    assert taker.claim("s3") is None and taker.claim("s4") is None
    taker.close()


def test_cleanup_spares_parts_of_shards_with_a_live_lease(run):
    store = ShardStore(run, "extract")
    leases = LeaseTable(run, "extract", ttl_s=30.0, heartbeat_s=0.2)
    assert leases.claim("s1") is not None
    live = store.part_writer("s1", "t1", "bin")
    live.write(b"a" * 10, rows=1)
    live.write(b"b" * 10, rows=1)
    stray = store.part_writer("s2", "t2", "bin")  # a crashed attempt, no lease left
    stray.write(b"c" * 10, rows=1)
    removed = store.cleanup(protected=leases.live_shards)
    assert removed == ["extract/data/s2.t2.p0000.bin"]
    assert run.listdir("extract/data") == ["s1.t1.p0000.bin", "s1.t1.p0001.bin"]
    # The live attempt still commits (cleanup would have broken it with a CommitConflict).
    dead = pa.Table.from_pylist([], schema=pa.schema([("request_id", pa.string())]))
    result = store.commit_parts(live, ["r1", "r2"], ShardCommit(live.shard_id, live.attempt, "fp", ["r1", "r2"], dead))
    assert result.won and len(result.marker["parts"]) == 2
    leases.close()
    assert store.cleanup(protected=leases.live_shards) == []
    assert sorted(store.committed()) == ["s1"]


# ---- the issue's test: two CLI workers, one kill -9'd mid-shard --------------------------------


def _leases(run: RunFolder) -> dict[str, list[dict]]:
    """shard -> its lease records by epoch."""
    out: dict[str, list[dict]] = {}
    for name in run.listdir("generate/leases"):
        if name.startswith(TMP_PREFIX):  # a lease being written (temp + rename), as the reader skips it
            continue
        shard, epoch = name.removesuffix(".json").rsplit(".", 1)
        out.setdefault(shard, []).append((int(epoch), run.read_json(f"generate/leases/{name}")))
    return {s: [r for _, r in sorted(recs, key=lambda x: x[0])] for s, recs in out.items()}


def test_worker_killed_mid_shard_is_taken_over_at_once(tmp_path, tiny_target_dir):
    """The victim dies on this host: its lease is taken over as soon as the survivor looks,
    not after the lease's TTL (two minutes here, as by default)."""
    run_dir = tmp_path / "run"
    params = write_params(
        tmp_path,
        tiny_target_dir,
        str(run_dir),
        sampling={"max_new_tokens": 8, "samples_per_prompt": 1},
        engine={"kind": "local", "batch_size": 2},
        discover={"total_prompts": 18},
        generate={
            "shard_size": 6,
            "max_parallel_shards": 1,
            "lease_ttl_s": 120.0,
            "lease_heartbeat_s": 0.5,
            "progress_interval_s": 1,
        },
        stages=["discover", "generate"],
    )
    run = RunFolder(str(run_dir))
    with prefect_server(tmp_path / "prefect-home") as api:
        env = cli_env(tmp_path, PREFECT_API_URL=api)
        args = ["run", "--params", str(params)]
        assert start_cli([*args, "--stages", "discover"], env, tmp_path / "d.log").wait(300) == 0
        # The victim kills its own process group mid-commit of its first shard (data written,
        # no marker), holding that shard's lease; the survivor starts once the victim holds one.
        victim = start_cli(args, {**env, "EAGLESCALE_FAILPOINT": "commit.after_data"}, tmp_path / "victim.log")
        survivor = None
        try:
            target: list[str] = []

            def victim_holds_a_lease() -> bool:
                target[:] = [s for s, records in _leases(run).items() if records[-1]["holder"]["pid"] == victim.pid]
                return bool(target) or victim.poll() is not None

            _until(victim_holds_a_lease, "the victim to claim a shard", 300)
            assert target, (tmp_path / "victim.log").read_text()[-3000:]
            survivor = start_cli(args, env, tmp_path / "survivor.log")
            assert victim.wait(timeout=300) != 0  # killed by its failpoint
            killed_at = time.time()
            assert survivor.wait(timeout=300) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
        finally:
            for proc in (victim, survivor):
                with contextlib.suppress(ProcessLookupError, AttributeError):
                    os.killpg(proc.pid, signal.SIGKILL)

    rows, dead = assert_exactly_once(run)
    assert rows + dead == 18
    markers = ShardStore(run, "generate").committed()
    assert len(markers) == 3 and ShardStore(run, "generate").is_complete()
    shard = target[0]
    records = _leases(run)[shard]
    assert len(records) >= 2, records
    taker = records[-1]
    assert taker["holder"]["pid"] == survivor.pid and taker["released"]
    assert taker["took_over"]["holder"]["pid"] == victim.pid
    assert taker["took_over"]["holder_gone"] is True
    assert 0 < taker["acquired_at"] - killed_at < 60  # at once, not after the 120 s TTL
    # No duplicated work: the victim died after journaling every result of its shard, so the
    # survivor replayed that journal and sent nothing again (no second journal anywhere).
    attempts = {s: len(run.listdir(f"generate/journal/{s}")) for s in markers}
    assert attempts == dict.fromkeys(markers, 1), attempts
