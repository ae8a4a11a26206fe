"""The commit protocol on a local run root: journals, verified commit, markers, cleanup, races."""

from __future__ import annotations

import json
import threading

import pyarrow as pa
import pytest

from tasks.runfolder import (
    CommitError,
    FingerprintMismatch,
    JournalWriter,
    RunFolder,
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
        store.commit("s0", _rows(["a", "b"]), _dead([]), planned, "t1", "fp")
    with pytest.raises(CommitError, match="duplicate keys"):
        store.commit("s0", _rows(["a", "a", "b", "c"]), _dead([]), planned, "t1", "fp")
    with pytest.raises(CommitError, match="both committed and dead"):
        store.commit("s0", _rows(["a", "b", "c"]), _dead(["c"]), planned, "t1", "fp")
    assert store.committed() == {}
    result = store.commit("s0", _rows(["a", "b"]), _dead(["c"]), planned, "t1", "fp")
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
    store.commit("s0", _rows(["a"]), _dead([]), {"a"}, "t1", "fp")
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
        results.append(store.commit("s0", _rows(keys), _dead([]), set(keys), f"attempt{n}", "fp"))

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
    store.commit("s0", _rows(["a"]), _dead(["b"]), {"a", "b"}, "t1", "fp")
    store.commit("s0", _rows(["a", "b"]), _dead([]), {"a", "b"}, "t2", "fp", replace=True)
    marker = store.committed()["s0"]
    assert (marker["rows"], marker["dead"], marker["attempt"]) == (2, 0, "t2")
    assert run.listdir("generate/data") == ["s0.t2.parquet"]
    assert run.listdir("generate/dead") == ["s0.t2.parquet"]
