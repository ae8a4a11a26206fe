"""The commit protocol on a local run root: journals, verified commit, markers, cleanup, races."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pyarrow as pa
import pytest

from tasks.runfolder import (
    CommitConflict,
    CommitError,
    CorruptShard,
    FingerprintMismatch,
    JournalWriter,
    RunFolder,
    ShardCommit,
    ShardStore,
    ensure_fingerprint,
    read_journal,
    request_id,
)

SCHEMA = pa.schema([("request_id", pa.string()), ("value", pa.int64())])
DEAD = pa.schema([("request_id", pa.string()), ("error_class", pa.string())])


def _rows(keys: list[str]) -> pa.Table:
    return pa.Table.from_pylist([{"request_id": k, "value": i} for i, k in enumerate(keys)], schema=SCHEMA)


def _dead(keys: list[str]) -> pa.Table:
    return pa.Table.from_pylist([{"request_id": k, "error_class": "http_400"} for k in keys], schema=DEAD)


def test_fingerprint_written_then_mismatch_names_fields(tmp_path):
    run = RunFolder(str(tmp_path / "run"))
    fp = {"target": {"model_path": "/m", "chat_template_hash": "aa"}, "sampling": {"temperature": 0.0}}
    h = ensure_fingerprint(run, fp)
    assert ensure_fingerprint(run, fp) == h
    changed = {"target": {"model_path": "/m", "chat_template_hash": "bb"}, "sampling": {"temperature": 0.7}}
    with pytest.raises(FingerprintMismatch) as err:
        ensure_fingerprint(run, changed)
    msg = str(err.value)
    assert "target.chat_template_hash: 'aa' -> 'bb'" in msg
    assert "sampling.temperature: 0.0 -> 0.7" in msg
    assert "model_path" not in msg
    # The override keeps the original hash so committed keys stay valid, and records history.
    assert ensure_fingerprint(run, changed, allow_change=True) == h
    assert len(run.read_json("run.json")["overrides"]) == 1
    # Ensured again with the same override (the parent and generate flows, with overlap): once.
    assert ensure_fingerprint(run, changed, allow_change=True) == h
    assert len(run.read_json("run.json")["overrides"]) == 1
    # A further change is a new entry.
    other = {**changed, "sampling": {"temperature": 0.9}}
    assert ensure_fingerprint(run, other, allow_change=True) == h
    assert len(run.read_json("run.json")["overrides"]) == 2


def test_request_ids_are_order_free_content_hashes():
    a = request_id("fp", "p1", 0)
    assert a == request_id("fp", "p1", 0)
    assert len({a, request_id("fp", "p1", 1), request_id("fp", "p2", 0), request_id("fp2", "p1", 0)}) == 4


def test_journal_replay_skips_torn_last_line(tmp_path):
    run = RunFolder(str(tmp_path))
    w = JournalWriter(run, "generate", "s0", "20260101T000000-1-aaaaaa", flush_s=0.05)
    for i in range(5):
        w.append({"request_id": f"r{i}", "status": "ok"})
    w.close()
    path = tmp_path / "generate/journal/s0/20260101T000000-1-aaaaaa.jsonl"
    with open(path, "a") as f:
        f.write('{"request_id": "r5", "sta')  # a crash mid-write
    w2 = JournalWriter(run, "generate", "s0", "20260101T000001-1-bbbbbb")
    w2.append({"request_id": "r6", "status": "ok"})
    w2.close()
    replay = read_journal(run, "generate", "s0")
    assert [r["request_id"] for r in replay.records] == ["r0", "r1", "r2", "r3", "r4", "r6"]
    assert replay.torn_lines == 1
    assert len(replay.attempts) == 2


def test_commit_verifies_keys_and_marker_sha(tmp_path):
    run = RunFolder(str(tmp_path))
    store = ShardStore(run, "generate")
    planned = {"a", "b", "c"}
    with pytest.raises(CommitError, match="1 planned keys missing"):
        store.commit(_rows(["a", "b"]), ShardCommit("s0", "t1", "fp", planned, _dead([])))
    with pytest.raises(CommitError, match="duplicate keys"):
        store.commit(_rows(["a", "a", "b", "c"]), ShardCommit("s0", "t1", "fp", planned, _dead([])))
    with pytest.raises(CommitError, match="both committed and dead"):
        store.commit(_rows(["a", "b", "c"]), ShardCommit("s0", "t1", "fp", planned, _dead(["c"])))
    assert store.committed() == {}
    result = store.commit(_rows(["a", "b"]), ShardCommit("s0", "t1", "fp", planned, _dead(["c"])))
    assert result.won
    marker = store.committed()["s0"]
    assert (marker["rows"], marker["dead"]) == (2, 1)
    assert store.read_rows(marker).column("request_id").to_pylist() == ["a", "b"]
    # Corrupt the data: readers refuse it.
    (tmp_path / marker["data"]).write_bytes(b"garbage")
    with pytest.raises(CommitError, match="sha256 does not match"):
        store.read_rows(marker)


def test_cleanup_removes_temp_and_unmarked_objects(tmp_path):
    run = RunFolder(str(tmp_path))
    store = ShardStore(run, "generate")
    store.commit(_rows(["a"]), ShardCommit("s0", "t1", "fp", {"a"}, _dead([])))
    run.write_bytes_atomic("generate/data/s1.t9.parquet", b"unmarked")
    run.write_bytes_atomic("generate/data/.tmp-abc-s2.parquet", b"temp")
    run.write_bytes_atomic("generate/_SUCCESS/.tmp-abc-s3.json", b"{")
    removed = store.cleanup()
    assert sorted(removed) == [
        "generate/_SUCCESS/.tmp-abc-s3.json",
        "generate/data/.tmp-abc-s2.parquet",
        "generate/data/s1.t9.parquet",
    ]
    assert sorted(run.listdir("generate/data")) == ["s0.t1.parquet"]
    assert store.read_rows(store.committed()["s0"]).num_rows == 1


def test_racing_writers_commit_exactly_once(tmp_path):
    run = RunFolder(str(tmp_path))
    keys = [f"k{i}" for i in range(200)]
    results = []
    barrier = threading.Barrier(4)

    def writer(n: int) -> None:
        store = ShardStore(RunFolder(str(tmp_path)), "generate")
        barrier.wait()
        results.append(store.commit(_rows(keys), ShardCommit("s0", f"attempt{n}", "fp", set(keys), _dead([]))))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.won for r in results) == 1
    store = ShardStore(run, "generate")
    marker = store.committed()["s0"]
    assert run.listdir("generate/data") == [f"s0.{marker['attempt']}.parquet"]
    assert sorted(store.read_rows(marker).column("request_id").to_pylist()) == sorted(keys)
    assert json.loads((tmp_path / "generate/_SUCCESS/s0.json").read_text())["sha256"] == marker["sha256"]


def test_replace_recommits_and_drops_old_files(tmp_path):
    run = RunFolder(str(tmp_path))
    store = ShardStore(run, "generate")
    store.commit(_rows(["a"]), ShardCommit("s0", "t1", "fp", {"a", "b"}, _dead(["b"])))
    store.commit(_rows(["a", "b"]), ShardCommit("s0", "t2", "fp", {"a", "b"}, _dead([]), replace=True))
    marker = store.committed()["s0"]
    assert (marker["rows"], marker["dead"], marker["attempt"]) == (2, 0, "t2")
    assert run.listdir("generate/data") == ["s0.t2.parquet"]
    assert run.listdir("generate/dead") == ["s0.t2.parquet"]


# -- multi-part shards ----------------------------------------------------------------------


def _write_parts(store: ShardStore, shard_id: str, attempt: str, chunks: list[list[str]]):
    parts = store.part_writer(shard_id, attempt, "bin")
    for chunk in chunks:
        parts.write(",".join(chunk).encode(), len(chunk))
    return parts


def _of(parts, planned: set[str], dead: pa.Table, **options) -> ShardCommit:
    """The commit of a multi-part attempt, under its own shard and attempt."""
    return ShardCommit(parts.shard_id, parts.attempt, "fp", planned, dead, **options)


def _keys_of(store: ShardStore, marker: dict) -> list[str]:
    return [k for data in store.iter_parts(marker) for k in data.decode().split(",")]


def test_parts_commit_under_one_marker_and_read_back_verified(tmp_path):
    run = RunFolder(str(tmp_path))
    store = ShardStore(run, "extract")
    chunks = [["a", "b"], ["c"], ["d", "e"]]
    parts = _write_parts(store, "s0", "t1", chunks)
    result = store.commit_parts(parts, ["a", "b", "c", "d", "e"], _of(parts, set("abcdef"), _dead(["f"])))
    assert result.won
    marker = store.committed()["s0"]
    assert "data" not in marker and "sha256" not in marker
    assert [p["path"] for p in marker["parts"]] == [
        "extract/data/s0.t1.p0000.bin",
        "extract/data/s0.t1.p0001.bin",
        "extract/data/s0.t1.p0002.bin",
    ]
    assert [p["rows"] for p in marker["parts"]] == [2, 1, 2]
    assert [p["bytes"] for p in marker["parts"]] == [3, 1, 3]
    assert (marker["rows"], marker["dead"]) == (5, 1)
    assert _keys_of(store, marker) == ["a", "b", "c", "d", "e"]
    assert store.read_part(marker, 1) == b"c"
    with pytest.raises(IndexError, match="part 3 of 3"):
        store.read_part(marker, 3)
    with pytest.raises(CommitError, match="3 data parts; read them with read_part"):
        store.read_payload(marker)
    # A single-object shard reads as one part.
    store.commit_payload(b"x", "bin", ["x"], ShardCommit("s1", "t1", "fp", {"x"}, _dead([])))
    assert list(store.iter_parts(store.committed()["s1"])) == [b"x"]
    # A corrupted part is refused by its reader; the others still read.
    (tmp_path / marker["parts"][2]["path"]).write_bytes(b"d,X")
    assert store.read_part(marker, 0) == b"a,b"
    with pytest.raises(CommitError, match=r"s0\.t1\.p0002\.bin: sha256 does not match"):
        store.read_part(marker, 2)


def test_parts_that_fail_verification_are_removed(tmp_path):
    run = RunFolder(str(tmp_path))
    store = ShardStore(run, "extract")
    parts = _write_parts(store, "s0", "t1", [["a"], ["b"]])
    with pytest.raises(CommitError, match="1 planned keys missing"):
        store.commit_parts(parts, ["a", "b"], _of(parts, {"a", "b", "c"}, _dead([])))
    assert run.listdir("extract/data") == [] and store.committed() == {}
    parts = _write_parts(store, "s0", "t2", [["a"], ["b"]])
    with pytest.raises(CommitError, match="its 2 parts hold 2 rows but 3 keys were given"):
        store.commit_parts(parts, ["a", "b", "c"], _of(parts, {"a", "b", "c"}, _dead([])))
    assert run.listdir("extract/data") == []
    # The commit names the parts' own shard and attempt: another's is a caller's mistake.
    parts = _write_parts(store, "s0", "t3", [["a"]])
    with pytest.raises(ValueError, match="parts of shard s0 attempt t3 committed as shard s0 attempt t9"):
        store.commit_parts(parts, ["a"], ShardCommit("s0", "t9", "fp", {"a"}, _dead([])))
    assert store.committed() == {}


def test_a_part_gone_before_the_marker_is_a_conflict_not_a_commit(tmp_path):
    run = RunFolder(str(tmp_path))
    store = ShardStore(run, "extract")
    parts = _write_parts(store, "s0", "t1", [["a"], ["b"]])
    run.remove(parts.parts[1]["path"])  # a concurrent cleanup took it
    with pytest.raises(CommitConflict, match="shard s0: data vanished"):
        store.commit_parts(parts, ["a", "b"], _of(parts, {"a", "b"}, _dead([])))
    assert store.committed() == {}
    # A part of the wrong size is caught the same way (size check, no re-read).
    parts = _write_parts(store, "s0", "t2", [["a"], ["b"]])
    run.write_bytes_atomic(parts.parts[0]["path"], b"aa")
    with pytest.raises(CommitConflict):
        store.commit_parts(parts, ["a", "b"], _of(parts, {"a", "b"}, _dead([])))


def test_cleanup_and_replace_handle_parts(tmp_path):
    run = RunFolder(str(tmp_path))
    store = ShardStore(run, "extract")
    parts = _write_parts(store, "s0", "t1", [["a"], ["b"]])
    store.commit_parts(parts, ["a", "b"], _of(parts, {"a", "b"}, _dead([])))
    _write_parts(store, "s1", "t7", [["c"], ["d"]])  # an attempt killed before its marker
    assert sorted(store.cleanup()) == ["extract/data/s1.t7.p0000.bin", "extract/data/s1.t7.p0001.bin"]
    assert run.listdir("extract/data") == ["s0.t1.p0000.bin", "s0.t1.p0001.bin"]
    # retry-dead: the new attempt's parts replace every part of the previous one.
    parts = _write_parts(store, "s0", "t2", [["a", "b"], ["c"], ["d"]])
    store.commit_parts(parts, ["a", "b", "c", "d"], _of(parts, {"a", "b", "c", "d"}, _dead([]), replace=True))
    assert run.listdir("extract/data") == ["s0.t2.p0000.bin", "s0.t2.p0001.bin", "s0.t2.p0002.bin"]
    assert run.listdir("extract/dead") == ["s0.t2.parquet"]
    assert _keys_of(store, store.committed()["s0"]) == ["a", "b", "c", "d"]
    assert store.cleanup() == []


def test_racing_part_writers_one_winner_losers_parts_gone(tmp_path):
    keys = [f"k{i}" for i in range(30)]
    results = []
    barrier = threading.Barrier(4)

    def writer(n: int) -> None:
        store = ShardStore(RunFolder(str(tmp_path)), "extract")
        parts = _write_parts(store, "s0", f"attempt{n}", [keys[:10], keys[10:20], keys[20:]])
        barrier.wait()
        results.append(store.commit_parts(parts, keys, _of(parts, set(keys), _dead([]))))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.won for r in results) == 1
    run = RunFolder(str(tmp_path))
    store = ShardStore(run, "extract")
    marker = store.committed()["s0"]
    winner = marker["attempt"]
    assert all(r.marker["attempt"] == winner for r in results)
    assert run.listdir("extract/data") == [f"s0.{winner}.p000{i}.bin" for i in range(3)]
    assert run.listdir("extract/dead") == [f"s0.{winner}.parquet"]
    assert _keys_of(store, marker) == keys


def test_committed_reads_each_marker_once_until_it_is_rewritten(tmp_path):
    run = RunFolder(str(tmp_path / "run"))
    store = ShardStore(run, "generate")
    store.commit(_rows(["a"]), ShardCommit("s0", "t1", "fp", {"a", "b"}, _dead(["b"])))
    store.commit(_rows(["c"]), ShardCommit("s1", "t1", "fp", {"c"}, _dead([])))
    reads: list[str] = []
    read_json = run.read_json
    run.read_json = lambda rel: reads.append(rel) or read_json(rel)  # counts the store's GETs
    assert set(store.committed()) == {"s0", "s1"} and len(reads) == 2
    assert store.committed()["s0"]["attempt"] == "t1" and len(reads) == 2  # served from the cache
    # Another writer (a second store on the same run) replaces s0: the next scan sees it.
    ShardStore(RunFolder(str(tmp_path / "run")), "generate").commit(
        _rows(["a", "b"]), ShardCommit("s0", "t2", "fp", {"a", "b"}, _dead([]), replace=True)
    )
    assert store.committed()["s0"]["attempt"] == "t2"
    assert reads[2:] == ["generate/_SUCCESS/s0.json"]


# -- damage found on resume, temp files left by a failed write ------------------------------


def test_damaged_shards_are_found_by_size_and_sha_and_a_torn_marker_is_named(tmp_path):
    run = RunFolder(str(tmp_path))
    gen, ext = ShardStore(run, "generate"), ShardStore(run, "extract")
    for shard in ("s0", "s1", "s2", "s3"):
        gen.commit(_rows(["a", "b"]), ShardCommit(shard, "t1", "fp", {"a", "b", "c"}, _dead(["c"])))
    parts = _write_parts(ext, "s0", "t1", [["a"], ["b"]])
    ext.commit_parts(parts, ["a", "b"], _of(parts, {"a", "b"}, _dead([])))
    assert gen.damaged(gen.committed(), hash_data=True) == {} and ext.damaged(ext.committed()) == {}
    markers = gen.committed()
    data = tmp_path / markers["s1"]["data"]
    flipped = bytearray(data.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF  # same size: only a sha256 sees it
    data.write_bytes(bytes(flipped))
    (tmp_path / markers["s2"]["data"]).write_bytes(data.read_bytes()[:-5])  # torn
    (tmp_path / markers["s3"]["dead_path"]).unlink()
    by_size = gen.damaged(markers)
    assert set(by_size) == {"s2", "s3"}
    assert "bytes, its marker records" in by_size["s2"] and by_size["s3"].endswith("is missing")
    assert set(gen.damaged(markers, hash_data=True)) == {"s1", "s2", "s3"}
    with pytest.raises(CorruptShard, match=r"s1\.t1\.parquet: sha256 does not match .*delete generate/_SUCCESS/s1\.json and resume"):
        gen.read_rows(markers["s1"])
    part = tmp_path / ext.committed()["s0"]["parts"][1]["path"]
    part.write_bytes(b"bb")
    assert "p0001.bin has 2 bytes, its marker records 1" in ext.damaged(ext.committed())["s0"]
    # A marker is linked into place whole, so a torn one is damage: named, with the fix.
    (tmp_path / "generate/_SUCCESS/s0.json").write_text('{"shard_id": "s0", "rows"')
    with pytest.raises(CorruptShard, match=r"generate/_SUCCESS/s0\.json: the commit marker is not valid JSON.*delete"):
        ShardStore(run, "generate").committed()


def test_a_failed_write_leaves_no_temp_and_old_temps_are_swept(tmp_path, monkeypatch):
    run = RunFolder(str(tmp_path))
    run.write_bytes_atomic("generate/progress.json", b"{}")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", disk_full)
        with pytest.raises(OSError, match="No space left"):
            run.write_bytes_atomic("generate/progress.json", b'{"a": 1}')
        with pytest.raises(OSError, match="No space left"):
            run.create_exclusive("generate/_SUCCESS/s0.json", b"{}")
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == []
    # What a kill -9 mid-write leaves, anywhere in the run folder: swept once nothing writes it.
    old = time.time() - 3600
    for rel in ("stages/.tmp-1a2b-generate.json", "prompts/.tmp-3c4d-manifest.parquet", "train/.tmp-5e6f-final/config.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    for rel in ("stages/.tmp-1a2b-generate.json", "prompts/.tmp-3c4d-manifest.parquet", "train/.tmp-5e6f-final"):
        os.utime(tmp_path / rel, (old, old))
    (tmp_path / "generate/.tmp-7a8b-progress.json").write_bytes(b"{")  # a write in flight
    assert run.remove_stray_temps() == ["prompts/.tmp-3c4d-manifest.parquet", "stages/.tmp-1a2b-generate.json", "train/.tmp-5e6f-final"]
    assert (tmp_path / "generate/.tmp-7a8b-progress.json").exists() and not (tmp_path / "train/.tmp-5e6f-final").exists()
