"""The commit protocol on an s3:// run root against moto's S3 server."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from tasks.runfolder import (
    JournalWriter,
    RunFolder,
    ShardCommit,
    ShardStore,
    ensure_fingerprint,
    read_journal,
)
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
    assert store.commit(_rows(keys), ShardCommit("s0", "t1", "fp", set(keys), _rows([]))).won
    assert not store.commit(_rows(keys), ShardCommit("s0", "t2", "fp", set(keys), _rows([]))).won
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
        results.append(store.commit(_rows(keys), ShardCommit("s0", f"a{n}", "fp", set(keys), _rows([]))))

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


def _extract_parts(run: RunFolder, attempt: str, seqs, states) -> tuple:
    from tasks.extract.storage import ShardWriter, verify_shard

    store = ShardStore(run, "extract")
    parts = store.part_writer("s0", attempt, "safetensors")
    keys: list[str] = []

    def write(data: bytearray) -> None:
        part_keys = verify_shard(data)
        parts.write(data, len(part_keys))
        keys.extend(part_keys)

    writer = ShardWriter(16, [1, 3, 4], "bf16", part_bytes=25 * (8 * 16 + 5), on_part=write)
    writer.add_many(seqs, states)
    writer.flush()
    return store, parts, keys


def test_s3_multi_part_extract_shard_commits_once_and_reads_back(s3_run):
    import torch

    from tasks.extract.local_capture import CapturedStates
    from tasks.extract.sequences import TrainingSequence
    from tasks.extract.storage import iter_extracted

    gen = torch.Generator().manual_seed(3)
    lengths = [12, 9, 15, 7, 11, 14]
    states = [CapturedStates(torch.randn(n, 48, generator=gen), torch.randn(n, 16, generator=gen)) for n in lengths]
    seqs = [
        TrainingSequence(f"r{i}", f"p{i}", "d", "train" if i % 3 else "eval", list(range(n)), [0] + [1] * (n - 1), False)
        for i, n in enumerate(lengths)
    ]
    dead = pa.Table.from_pylist([], schema=SCHEMA)
    planned = {s.sequence_id for s in seqs}
    store, parts, keys = _extract_parts(s3_run, "t1", seqs, states)
    assert len(parts.parts) == 4 and keys == [s.sequence_id for s in seqs]
    assert store.commit_parts(parts, keys, ShardCommit(parts.shard_id, parts.attempt, "fp", planned, dead)).won
    # A second writer of the same shard loses on S3 too, and its parts are deleted.
    _, late, late_keys = _extract_parts(s3_run, "t2", seqs, states)
    assert not store.commit_parts(late, late_keys, ShardCommit(late.shard_id, late.attempt, "fp", planned, dead)).won
    _extract_parts(s3_run, "t3", seqs, states)  # killed before its marker
    assert len(store.cleanup()) == 4
    marker = store.committed()["s0"]
    assert s3_run.listdir("extract/data") == [f"s0.t1.p000{i}.safetensors" for i in range(4)]
    assert [p["rows"] for p in marker["parts"]] == [2, 2, 1, 1]
    back = list(iter_extracted(s3_run))
    assert [s.sequence_id for s in back] == keys
    for seq, st in zip(back, states, strict=True):
        assert torch.equal(seq.aux_hidden, st.aux.to(torch.bfloat16).float())
    assert [s.sequence_id for s in iter_extracted(s3_run, "eval")] == ["r0", "r3"]
