"""The extract stage end to end on the tiny target: every committed generation row extracted
exactly once, stored states equal to what decode-time capture feeds a draft, the disk
forecast, pipelining on partially committed generation, and changed settings."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.draft.data import ShardReader, build_index, plan_epoch
from tasks.extract.forecast import DiskForecastError, forecast_extract
from tasks.extract.local_capture import decode_capture
from tasks.extract.sizes import human_bytes
from tasks.extract.stage import ExtractStage
from tasks.extract.storage import extract_metadata, iter_extracted
from tasks.runfolder import CorruptShard, FingerprintMismatch, RunFolder, ShardStore
from tasks.target.tokenizer import load_tokenizer
from tests.extract_support import MAX_NEW_TOKENS, extracted_ids, generated_run
from tests.run_support import committed_ids, unmarked_objects

IDS = [1, 3, 4]
# ~116 tokens of the tiny target's states (517 bytes/token): 4 to 8 parts per shard.
PART_BYTES = 60_000


def _stage(base, model_dir, dest, part_bytes=None, **extract):
    cfg, _ = generated_run(base, model_dir, dest, **extract)
    run = RunFolder(cfg.run_root)
    tokenizer = load_tokenizer(cfg.target.model_path)
    return cfg, run, ExtractStage(cfg, run, tokenizer, part_bytes=part_bytes)


def _run_all(stage: ExtractStage) -> dict:
    for shard_id in stage.prepare():
        assert stage.run_shard(shard_id).status == "committed"
    return stage.finish()


def test_every_generated_row_is_extracted_once_and_matches_decode_time_capture(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, run, stage = _stage(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path)
    generated = ShardStore(run, "generate").committed()
    assert stage.prepare() == sorted(generated)
    assert stage.forecast["fits"] and stage.forecast["bytes_per_token"] == 8 * 64 + 5
    summary = _run_all(stage)
    assert summary["complete"] and ShardStore(run, "extract").is_complete()

    rows, dead = extracted_ids(run)
    gen_rows, _ = committed_ids(run, "generate")
    assert len(rows) == len(set(rows)) and not set(rows) & set(dead)
    assert sorted(rows + dead) == sorted(gen_rows)
    assert summary["dead"] == len(dead) > 0  # prompts longer than max_length 256

    seqs = list(iter_extracted(run))
    assert [s.sequence_id for s in seqs] == rows
    assert sorted(s.sequence_id for s in iter_extracted(run, "eval")) == sorted(
        s.sequence_id for s in seqs if s.split == "eval"
    )
    meta = extract_metadata(run)
    assert {
        k: meta[k]
        for k in ("hidden_size", "aux_layer_ids", "storage_dtype", "sequences", "complete")
    } == {
        "hidden_size": 64,
        "aux_layer_ids": IDS,
        "storage_dtype": "bf16",
        "sequences": len(rows),
        "complete": True,
    }
    assert (
        meta["splits"]["train"] + meta["splits"]["eval"] == len(rows) and meta["splits"]["eval"] > 0
    )
    assert meta["tokens"] == sum(len(s.input_ids) for s in seqs)
    for shard_id, marker in ShardStore(run, "extract").committed().items():
        assert marker["source_sha256"] == generated[shard_id]["sha256"]
        assert (marker["aux_layer_ids"], marker["hidden_size"], marker["max_length"]) == (
            IDS,
            64,
            256,
        )
        assert 0 < marker["reconstruction_error"]["aux"]["rel_rms"] < 2**-8

    # Resume: nothing left to do, and a rerun of a shard is skipped.
    again = ExtractStage(cfg, run, load_tokenizer(cfg.target.model_path))
    assert again.prepare() == []
    assert again.run_shard(sorted(generated)[0]).status == "skipped"
    # A resume checks what it skips: a part cut short is extracted again, once.
    first, second = sorted(generated)[:2]
    torn = ShardStore(run, "extract").committed()[first]
    part = tmp_path / "run" / torn["parts"][0]["path"]
    part.write_bytes(part.read_bytes()[:-100])
    again = ExtractStage(cfg, run, load_tokenizer(cfg.target.model_path))
    assert again.prepare() == [first]
    assert again.run_shard(first).status == "committed"
    assert ShardStore(run, "extract").committed()[first]["attempt"] != torn["attempt"]
    assert ExtractStage(cfg, run, load_tokenizer(cfg.target.model_path)).prepare() == []
    assert [s.sequence_id for s in iter_extracted(run)] == rows
    # Damage only a sha256 sees is named where the bytes are read, with the fix.
    source = tmp_path / "run" / generated[second]["data"]
    flipped = bytearray(source.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    source.write_bytes(bytes(flipped))
    (tmp_path / "run" / f"extract/_SUCCESS/{second}.json").unlink()
    with pytest.raises(CorruptShard, match=rf"{generated[second]['data']}: sha256 does not match .* delete generate/_SUCCESS/{second}\.json and resume"):
        again.run_shard(second)

    # What extraction stored (bf16, after the storage round trip) is, position by position,
    # what greedy decoding with a KV cache feeds the draft. Stated tolerance: bf16 rounding
    # (2^-9 relative, doubled for margin) plus 1e-4 for fp32 kernel differences.
    model = AutoModelForCausalLM.from_pretrained(
        cfg.target.model_path, local_files_only=True
    ).eval()
    eos = frozenset({int(model.config.eos_token_id)})
    for seq in seqs[:12]:
        prompt_len = int(seq.loss_mask.int().argmax())
        decoded = decode_capture(
            model, seq.input_ids[:prompt_len].tolist(), IDS, MAX_NEW_TOKENS, eos
        )
        n = min(len(decoded.token_ids), len(seq.input_ids))
        assert n > prompt_len
        assert decoded.token_ids[:n] == seq.input_ids[:n].tolist()  # greedy regenerates the row
        for stored, live in (
            (seq.aux_hidden[:n], decoded.aux[:n]),
            (seq.last_hidden[:n], decoded.last[:n]),
        ):
            assert bool(((stored - live).abs() <= live.abs() * 2**-8 + 1e-4).all())


def test_forecast_refuses_before_any_work_naming_both_numbers(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, run, stage = _stage(
        tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path, quota_bytes=50_000
    )
    expected = forecast_extract(run, 64, "bf16", 256, 50_000, extra_per_sequence=1)
    assert not expected["fits"]
    with pytest.raises(DiskForecastError) as err:
        stage.prepare()
    message = str(err.value)
    assert (
        human_bytes(expected["needed_bytes"]) in message
        and f"{expected['needed_bytes']:,} bytes" in message
    )
    assert "50.0 kB" in message and "50,000 bytes" in message and "extract.quota_bytes" in message
    assert "fp8_e4m3" in message
    assert run.listdir("extract/data") == [] and stage._backend is None  # no model was loaded


def test_extraction_follows_generation_while_it_is_still_committing(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, run, stage = _stage(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path)
    shards = sorted(ShardStore(run, "generate").committed())
    # Roll generation back to "two shards not committed yet".
    held = {s: run.read_bytes(f"generate/_SUCCESS/{s}.json") for s in shards[-2:]}
    complete = run.read_bytes("generate/_COMPLETE")
    for s in held:
        run.remove(f"generate/_SUCCESS/{s}.json")
    run.remove("generate/_COMPLETE")
    assert stage.prepare() == shards[:-2]
    assert stage.forecast["projected_tokens"] > stage.forecast["committed_tokens"]  # extrapolated
    assert _run_all(stage)["complete"] is False and not run.exists("extract/_COMPLETE")

    # Two more shards commit and generation completes: exactly those are pending now.
    for s, body in held.items():
        run.write_bytes_atomic(f"generate/_SUCCESS/{s}.json", body)
    run.write_bytes_atomic("generate/_COMPLETE", complete)
    assert stage.pending_shards() == shards[-2:]
    summary = _run_all(stage)
    assert summary["complete"] and summary["shards_extracted"] == len(shards)
    assert run.read_json("extract/_COMPLETE")["sequences"] == summary["sequences"]


def test_following_generation_refuses_once_the_marked_shards_project_past_the_quota(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    from tasks.extract.follow import follow_generation

    cfg, run, stage = _stage(
        tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path, quota_bytes=50_000
    )
    # A fresh overlapped run: nothing marked yet when extraction starts, so the forecast fits.
    bodies = {k: run.read_bytes(k) for k in [f"generate/_SUCCESS/{s}.json" for s in ShardStore(run, "generate").committed()]}
    for key in bodies:
        run.remove(key)
    assert stage.prepare() == [] and stage.forecast["fits"]
    for key, body in bodies.items():  # generation marks its shards
        run.write_bytes_atomic(key, body)
    ran: list[str] = []
    with pytest.raises(DiskForecastError, match="extract.quota_bytes"):
        follow_generation(stage, lambda s: ran.append(s) or {"status": "committed"}, 0.05, lambda: False)
    assert ran == [] and run.listdir("extract/data") == []  # refused before any shard


def test_changed_settings_are_refused_then_re_extracted_in_fp8_when_allowed(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, run, stage = _stage(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path)
    _run_all(stage)
    bf16_bytes = stage.summary()["bytes"]
    fp8_cfg = cfg.model_copy(
        update={"extract": cfg.extract.model_copy(update={"storage_dtype": "fp8_e4m3"})}
    )
    tok = load_tokenizer(cfg.target.model_path)
    with pytest.raises(FingerprintMismatch) as err:
        ExtractStage(fp8_cfg, run, tok).prepare()
    assert "storage_dtype: 'bf16' -> 'fp8_e4m3'" in str(err.value)

    allowed = ExtractStage(fp8_cfg.model_copy(update={"allow_fingerprint_change": True}), run, tok)
    assert allowed.prepare() == sorted(ShardStore(run, "generate").committed())
    summary = _run_all(allowed)
    assert summary["complete"] and extract_metadata(run)["storage_dtype"] == "fp8_e4m3"
    assert 0 < summary["max_rel_rms_error"]["aux"] < 0.04
    assert summary["bytes"] < 0.6 * bf16_bytes
    assert len(run.listdir("extract/data")) == summary["shards_extracted"]  # old objects replaced
    seq = next(iter_extracted(run))
    assert seq.aux_hidden.dtype == torch.float32 and seq.aux_hidden.shape[1] == 3 * 64


def test_a_shard_of_another_held_out_split_is_refused(tmp_path_factory, tmp_path, tiny_target_dir):
    """Each marker records the held-out split's digest (not in the settings' hash: every
    extraction before the key would fail it). A shard extracted with another split would mix two
    in one run: refused, naming both; one from before the key (no digest) goes on where this
    run's prompts split the same way per prompt."""
    import json

    cfg, run, stage = _stage(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path)
    _run_all(stage)
    assert extract_metadata(run)["holdout"] == stage.builder.holdout
    key = "extract/_SUCCESS/" + sorted(k for k in run.listdir("extract/_SUCCESS") if k.endswith(".json"))[0]
    marker = json.loads(run.read_bytes(key))
    tok = load_tokenizer(cfg.target.model_path)
    run.write_bytes_atomic(key, json.dumps({**marker, "holdout": "0123456789abcdef"}).encode())
    with pytest.raises(FingerprintMismatch, match=r"was made with another held-out split \(0123456789abcdef\)"):
        ExtractStage(cfg, run, tok).prepare()
    assert extract_metadata(run)["holdout"] is None  # the shards disagree: no one split to record
    allowed = ExtractStage(cfg.model_copy(update={"allow_fingerprint_change": True}), run, tok)
    assert allowed.prepare() == [marker["shard_id"]]  # allowed: that shard is extracted again
    run.write_bytes_atomic(key, json.dumps({k: v for k, v in marker.items() if k != "holdout"}).encode())
    assert ExtractStage(cfg, run, tok).prepare() == []


def test_multi_part_shards_hold_exactly_what_one_object_per_shard_holds(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    base = tmp_path_factory.getbasetemp()
    _, run_one, one = _stage(base, tiny_target_dir, tmp_path / "one")
    _run_all(one)
    _, run, parted = _stage(base, tiny_target_dir, tmp_path / "parts", part_bytes=PART_BYTES)
    _run_all(parted)

    singles = ShardStore(run_one, "extract").committed()
    markers = ShardStore(run, "extract").committed()
    assert sorted(markers) == sorted(singles)
    for shard_id, marker in markers.items():
        assert len(singles[shard_id]["parts"]) == 1
        parts = marker["parts"]
        assert len(parts) >= 3, shard_id
        assert [p["path"] for p in parts] == [
            f"extract/data/{shard_id}.{marker['attempt']}.p{i:04d}.safetensors"
            for i in range(len(parts))
        ]
        assert sum(p["rows"] for p in parts) == marker["rows"] == singles[shard_id]["rows"]
        assert sum(p["bytes"] for p in parts) == marker["bytes"]
    # Several sequences share a part while they fit (a longer one is a part of its own).
    shared = [p["bytes"] for m in markers.values() for p in m["parts"] if p["rows"] > 1]
    assert shared and max(shared) <= PART_BYTES + 4096  # + header
    assert unmarked_objects(run, "extract") == set()

    want, got = list(iter_extracted(run_one)), list(iter_extracted(run))
    assert [s.sequence_id for s in got] == [s.sequence_id for s in want]
    for a, b in zip(got, want, strict=True):
        assert (a.domain, a.split) == (b.domain, b.split)
        for name in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (a.sequence_id, name)
    keys = ("sequences", "tokens", "loss_tokens", "splits", "complete")
    assert {k: extract_metadata(run)[k] for k in keys} == {
        k: extract_metadata(run_one)[k] for k in keys
    }

    # The trainer's data path reads parts: every sequence indexed once, batches within a part.
    index = build_index(run)
    by_id = {s.sequence_id: s for s in got}
    reader = ShardReader(run, index)
    assert len(index.refs) == len(got)
    assert sorted(reader.get(r).sequence_id for r in index.refs) == sorted(by_id)
    for ref in index.refs[:10]:
        seq = reader.get(ref)
        assert torch.equal(seq.aux_hidden, by_id[seq.sequence_id].aux_hidden)
    plan = plan_epoch(index, "train", 0, seed=1, batch_tokens=512)
    assert sorted((r.shard_id, r.part, r.index) for b in plan for r in b) == sorted(
        (r.shard_id, r.part, r.index) for r in index.split("train")
    )
    assert all(len({(r.shard_id, r.part) for r in batch}) == 1 for batch in plan)
