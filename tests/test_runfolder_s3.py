"""The commit protocol on an s3:// run root against moto's S3 server."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from tasks.runfolder import JournalWriter, RunFolder, ShardStore, ensure_fingerprint, read_journal
from tests.s3_support import moto_s3

SCHEMA = pa.schema([("request_id", pa.string())])


@pytest.fixture
def s3_run(monkeypatch):
    with moto_s3(monkeypatch) as s3:
        yield RunFolder(f"s3://{s3['bucket']}/runs/r1", s3["storage_options"])


def _rows(keys):
    return pa.Table.from_pylist([{"request_id": k} for k in keys], schema=SCHEMA)


def test_s3_journal_chunks_commit_and_cleanup(s3_run):
    run = s3_run
    ensure_fingerprint(run, {"a": 1})
    assert run.read_json("run.json")["fingerprint"] == {"a": 1}
    w = JournalWriter(run, "generate", "s0", "20260101T000000-1-aaaaaa", flush_s=0.05)
    for i in range(3):
        w.append({"request_id": f"r{i}", "status": "ok"})
    w.flush()
    w.append({"request_id": "r3", "status": "ok"})
    w.close()
    chunks = run.listdir("generate/journal/s0/20260101T000000-1-aaaaaa")
    assert len(chunks) >= 2 and all(c.endswith(".jsonl") for c in chunks)
    replay = read_journal(run, "generate", "s0")
    assert [r["request_id"] for r in replay.records] == ["r0", "r1", "r2", "r3"]

    store = ShardStore(run, "generate")
    keys = [f"r{i}" for i in range(4)]
    assert store.commit("s0", _rows(keys), _rows([]), set(keys), "t1", "fp").won
    assert not store.commit("s0", _rows(keys), _rows([]), set(keys), "t2", "fp").won
    run.write_bytes_atomic("generate/data/s9.t5.parquet", b"unmarked")
    assert store.cleanup() == ["generate/data/s9.t5.parquet"]
    marker = store.committed()["s0"]
    assert marker["attempt"] == "t1"
    assert sorted(store.read_rows(marker).column("request_id").to_pylist()) == keys
    assert run.listdir("generate/data") == ["s0.t1.parquet"]


def test_s3_racing_markers_exactly_one_winner(s3_run):
    keys = [f"k{i}" for i in range(50)]
    results = []
    barrier = threading.Barrier(3)

    def writer(n):
        store = ShardStore(RunFolder(s3_run.url, {"client_kwargs": s3_run.fs.client_kwargs}), "generate")
        barrier.wait()
        results.append(store.commit("s0", _rows(keys), _rows([]), set(keys), f"a{n}", "fp"))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.won for r in results) == 1
    store = ShardStore(s3_run, "generate")
    store.cleanup()
    marker = store.committed()["s0"]
    assert s3_run.listdir("generate/data") == [f"s0.{marker['attempt']}.parquet"]
