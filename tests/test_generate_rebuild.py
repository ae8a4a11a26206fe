"""A resume checks the generation shards it would skip: a damaged one is rebuilt from its
journal (nothing sent again), once; one whose journal cannot rebuild it is named, with the fix."""

from __future__ import annotations

import shutil

import pytest

from tasks.engines.local import LocalEngine
from tasks.generate.stage import GenerateStage, generation_fingerprint
from tasks.runfolder import CorruptShard, RunFolder, ShardStore
from tasks.target.tokenizer import load_tokenizer
from tests.extract_support import SHARD_SIZE, generated_run


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a sha256 sees it
    path.write_bytes(bytes(data))


def test_damaged_shards_are_rebuilt_from_their_journals_once(tmp_path_factory, tmp_path, tiny_target_dir):
    cfg, _ = generated_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path)
    run = RunFolder(cfg.run_root)
    store = ShardStore(run, "generate")
    markers = store.committed()
    flipped, torn, lost = sorted(markers)[:3]
    before = {s: store.read_rows(markers[s]).to_pylist() for s in (flipped, torn)}
    root = tmp_path / "run"
    _flip(root / markers[flipped]["data"])
    dead = root / markers[torn]["dead_path"]
    dead.write_bytes(dead.read_bytes()[:-7])
    _flip(root / markers[lost]["data"])
    shutil.rmtree(root / "generate/journal" / lost)

    tokenizer = load_tokenizer(cfg.target.model_path)
    engine = LocalEngine(cfg.target.model_path)
    stage = GenerateStage(cfg, run, generation_fingerprint(cfg, run, tokenizer), engine, tokenizer)
    try:
        assert stage.prepare() == [flipped, torn, lost]
        for shard_id in (flipped, torn):
            outcome = stage.run_shard(shard_id)
            assert (outcome.status, outcome.new_requests, outcome.replayed) == ("committed", 0, SHARD_SIZE)
            marker = store.marker(shard_id)
            assert marker["attempt"] != markers[shard_id]["attempt"]
            assert store.read_rows(marker).to_pylist() == before[shard_id]
        with pytest.raises(CorruptShard) as refused:
            stage.run_shard(lost)
        text = str(refused.value)
        assert markers[lost]["data"] in text and f"journal holds 0 of {SHARD_SIZE}" in text
        assert f"delete generate/_SUCCESS/{lost}.json and resume" in text
        summary = stage.finish()
        assert summary["shards_committed"] == summary["shards_total"] - 1
    finally:
        stage.close()
    # The next resume finds the rebuilt shards whole: only the unrebuildable one is left.
    again = GenerateStage(cfg, run, stage.fp_hash, engine, tokenizer)
    assert again.prepare() == [lost]
    again.close()
    engine.close()
    assert sorted(run.listdir("generate/data")) == sorted(
        f"{s}.{m['attempt']}.parquet" for s, m in store.committed().items()
    )
