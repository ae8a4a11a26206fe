"""Shard leases in the extract stage: two workers on one run root with one kill -9'd mid-shard
(every shard committed exactly once, the dead worker's shard taken over only once it is gone,
past its TTL or seen dead, and its parts removed), start-up cleanup that spares the parts of a shard leased elsewhere, and a
worker that finds its shard taken over stopping before the commit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from tasks.extract.stage import ExtractStage
from tasks.runfolder import LeaseTable, RunFolder, ShardStore
from tasks.runfolder.folder import json_bytes
from tasks.runfolder.schedule import ShardScheduler
from tasks.target.tokenizer import load_tokenizer
from tests.extract_support import extracted_ids, generated_run
from tests.run_support import ROOT, child_env, committed_ids, unmarked_objects

TTL_S = 3.0
# 4 to 8 parts per shard of the tiny target: a kill at the 3rd part is inside the first shard.
PART_BYTES = 60_000
VICTIM_FAILPOINT = "commit.after_part:3"


def _start(params, log_path, failpoint: str | None = None) -> subprocess.Popen:
    env = child_env(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("EAGLESCALE_FAILPOINT", None)
    if failpoint:
        env["EAGLESCALE_FAILPOINT"] = failpoint
    # Its own process group: the failpoint SIGKILLs the whole group, never pytest.
    return subprocess.Popen(
        [sys.executable, "-m", "tests.extract_support", str(params), str(PART_BYTES)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(log_path, "ab"),  # noqa: SIM115 - handed to the child
        text=True,
        start_new_session=True,
    )


def _leases(run: RunFolder) -> dict[str, list[dict]]:
    """shard -> its extract lease records by epoch."""
    out: dict[str, list[tuple[int, dict]]] = {}
    for name in run.listdir("extract/leases"):
        shard, epoch = name.removesuffix(".json").rsplit(".", 1)
        out.setdefault(shard, []).append((int(epoch), run.read_json(f"extract/leases/{name}")))
    return {s: [r for _, r in sorted(recs, key=lambda x: x[0])] for s, recs in out.items()}


def _shards_by_status(out: str) -> dict[str, set[str]]:
    by: dict[str, set[str]] = {}
    for line in out.splitlines():
        status, _, shard = line.partition(" ")
        if shard and status not in ("READY", "FAILED"):
            by.setdefault(status, set()).add(shard)
    return by


def test_two_workers_one_killed_mid_shard_every_shard_extracted_once(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, params = generated_run(
        tmp_path_factory.getbasetemp(),
        tiny_target_dir,
        tmp_path,
        batch_size=1,
        lease_ttl_s=TTL_S,
        lease_heartbeat_s=0.5,
    )
    run = RunFolder(cfg.run_root)
    shards = sorted(ShardStore(run, "generate").committed())
    assert len(shards) == 6
    victim = _start(params, tmp_path / "victim.log", VICTIM_FAILPOINT)
    survivor = None
    try:
        # The second worker starts once the first holds a shard.
        deadline = time.time() + 300
        while (
            not any(r[-1]["holder"]["pid"] == victim.pid for r in _leases(run).values())
            and victim.poll() is None
        ):
            assert time.time() < deadline, "the victim never claimed a shard"
            time.sleep(0.05)
        survivor = _start(params, tmp_path / "survivor.log")
        victim_out, _ = victim.communicate(timeout=300)
        assert victim.returncode == -signal.SIGKILL, victim_out
        survivor_out, _ = survivor.communicate(timeout=300)
        log = (tmp_path / "survivor.log").read_text()[-3000:]
        assert survivor.returncode == 0 and survivor_out.strip().endswith("COMPLETE"), log
    finally:
        for proc in (victim, survivor):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

    # Every committed generation row extracted (or dead-lettered) exactly once, nothing stray.
    rows, dead = extracted_ids(run)
    gen_rows, _ = committed_ids(run, "generate")
    assert len(rows) == len(set(rows)) and not set(rows) & set(dead)
    assert sorted(rows + dead) == sorted(gen_rows)
    assert sorted(ShardStore(run, "extract").committed()) == shards
    assert ShardStore(run, "extract").is_complete()
    assert unmarked_objects(run, "extract") == set()

    # The victim's shard: epoch 0 held by the victim, never released; epoch 1 the survivor's
    # takeover, claimed only once the victim was gone: its last heartbeat older than the TTL, or
    # its process seen dead on this host (holder_gone: once this test has reaped it, which can
    # come first; a CI run saw the takeover at 2.95 s of a 3 s TTL that way).
    leases = _leases(run)
    taken = [s for s, records in leases.items() if len(records) > 1]
    assert len(taken) == 1, leases
    first, taker = leases[taken[0]]
    assert first["holder"]["pid"] == victim.pid and not first["released"]
    assert taker["holder"]["pid"] == survivor.pid and taker["released"]
    took = taker["took_over"]
    assert took["holder"] == first["holder"]
    if not took["holder_gone"]:
        assert took["heartbeat_age_s"] > TTL_S
        assert taker["acquired_at"] - first["heartbeat_at"] > TTL_S
    assert taker["acquired_at"] > first["heartbeat_at"]

    # No shard was extracted twice: the victim committed none (killed in its first shard),
    # the survivor committed all six, each under a lease of its own.
    assert "COMMITTED" not in _shards_by_status(victim_out), victim_out
    assert _shards_by_status(survivor_out) == {"COMMITTED": set(shards)}, survivor_out
    assert all(records[-1]["holder"]["pid"] == survivor.pid for records in leases.values())


def test_cleanup_spares_a_shard_leased_elsewhere_and_a_taken_over_worker_stops_before_commit(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, _ = generated_run(
        tmp_path_factory.getbasetemp(),
        tiny_target_dir,
        tmp_path,
        lease_ttl_s=30.0,
        lease_heartbeat_s=0.2,
    )
    run = RunFolder(cfg.run_root)
    shards = sorted(ShardStore(run, "generate").committed())
    held, crashed = shards[0], shards[1]
    # Another worker, mid-shard: its lease is live and two of its parts are written.
    other = LeaseTable(run, "extract", ttl_s=30.0, heartbeat_s=0.2)
    assert other.claim(held) is not None
    store = ShardStore(run, "extract")
    live = store.part_writer(held, "a1", "safetensors")
    live.write(b"x" * 10, rows=1)
    live.write(b"y" * 10, rows=1)
    store.part_writer(crashed, "a2", "safetensors").write(b"z" * 10, rows=1)  # no lease left

    stage = ExtractStage(cfg, run, load_tokenizer(cfg.target.model_path))
    try:
        assert stage.prepare() == shards
        assert run.listdir("extract/data") == [
            f"{held}.a1.p0000.safetensors",
            f"{held}.a1.p0001.safetensors",
        ]
        # This worker neither runs nor schedules the shard another one holds: it waits on it.
        assert stage.run_shard(held).status == "leased"
        scheduler = ShardScheduler(stage, [held], max_running=1)
        assert scheduler.step() == [] and not scheduler.done
        assert (
            scheduler.waiting[held].startswith("leased by ")
            and "epoch 0" in scheduler.waiting[held]
        )
        assert store.marker(held) is None
        # Released without committing: the next start-up removes the abandoned parts.
        other.close()
        stage.prepare()
        assert run.listdir("extract/data") == []

        # Taken over while this worker extracts it: the attempt stops before the marker and
        # leaves no parts, and the lease is not released (it belongs to the taker now).
        victim_shard = shards[2]
        assert stage.claim(victim_shard)
        stolen = {"holder": other.holder, "epoch": 1, "ttl_s": 30.0, "seq": 0, "released": False}
        assert run.create_exclusive(f"extract/leases/{victim_shard}.1.json", json_bytes(stolen))
        assert stage.run_shard(victim_shard).status == "lease_lost"
        stage.release(victim_shard)
        assert store.marker(victim_shard) is None
        assert run.listdir("extract/data") == [] and run.listdir("extract/dead") == []
        assert not run.read_json(f"extract/leases/{victim_shard}.0.json")["released"]
        # The other shards still commit under this worker's leases.
        assert stage.run_shard(shards[3]).status == "committed"
        assert sorted(store.committed()) == [shards[3]]
        assert run.read_json(f"extract/leases/{shards[3]}.0.json")["released"]
    finally:
        stage.close()
