"""generate.reuse_from: a run whose prompt set grew sends only its new prompts. The earlier run's
committed replies to the prompts both runs hold are journaled into the new run's shards and
committed under its request ids; a stop and a resume journal nothing twice and resend nothing
held; an earlier run of another target or sampling, or one that is no run with committed
generation, is refused before any request, writing nothing. Real stages over real HTTP, against
the simulated SGLang server."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tasks.config import ConfigError, EagleScaleConfig, check_input_paths, load_config
from tasks.discover.commit import read_prompts_table
from tasks.engines.sglang_client import SGLangEngine
from tasks.generate.failures import ShardStopped
from tasks.generate.plan import planned_requests
from tasks.generate.stage import GenerateStage
from tasks.runfolder import FingerprintMismatch, RunFolder, ShardStore, read_journal
from tasks.runfolder.layout import GENERATE_PROGRESS
from tasks.standins.server import ServerProcess
from tasks.target.tiny import build_tiny_target
from tests.run_support import (
    ROOT,
    assert_exactly_once,
    discover_and_fingerprint,
    rows_by_request,
    write_params,
)

SAMPLES = ROOT / "tasks/data/sample_prompts"
CHAT_AND_REASONING = [
    {"name": "sample-chat", "path": str(SAMPLES / "general_chat.jsonl"), "domain": "general_chat"},
    {"name": "sample-reasoning", "path": str(SAMPLES / "reasoning.jsonl"), "domain": "reasoning"},
]
CODING = {"name": "sample-coding", "path": str(SAMPLES / "agentic_coding.jsonl"), "domain": "agentic_coding",
          "conversation_format": "sharegpt"}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        ["--simulate", "--step-latency-ms", "5", "--vocab-size", "2048", "--max-batch", "8"]
    )
    try:
        yield proc
    finally:
        proc.stop()


def _sent(url: str) -> int:
    return httpx.get(f"{url}/_stats").json()["generate_requests"]


def _config(folder: Path, model_dir: Path, url: str, sources: list[dict[str, Any]], max_new_tokens: int = 8,
            **generate: Any) -> EagleScaleConfig:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    params = write_params(
        folder, model_dir, str(folder / "run"),
        sampling={"max_new_tokens": max_new_tokens},
        engine={"kind": "sglang", "endpoints": [url], "concurrency_per_server": 8, "request_timeout_s": 60,
                "backoff_base_s": 0.01, "backoff_max_s": 0.05},
        generate={"shard_size": 40, **generate},
        discover={"sources": sources, "holdout_per_domain": 2},
    )  # fmt: skip
    return load_config(params)


def _stage(cfg: EagleScaleConfig) -> GenerateStage:
    run, tokenizer, fp_hash = discover_and_fingerprint(cfg)
    return GenerateStage(cfg, run, fp_hash, SGLangEngine(cfg.engine), tokenizer)


def _generate(stage: GenerateStage) -> dict[str, Any]:
    try:
        for shard_id in stage.prepare():
            assert stage.run_shard(shard_id).status == "committed"
        return stage.finish()
    finally:
        stage.engine.close()


def _keys(run: RunFolder) -> set[tuple[str, int]]:
    """(prompt_id, sample_index) of every request the run plans."""
    samples = run.read_json("run.json")["fingerprint"]["sampling"]["samples_per_prompt"]
    return {
        (p, k)
        for p in read_prompts_table(run, "manifest").column("prompt_id").to_pylist()
        for k in range(samples)
    }


def _committed_keys(run: RunFolder) -> set[tuple[str, int]]:
    """(prompt_id, sample_index) of every committed row."""
    return {(r["prompt_id"], r["sample_index"]) for r in rows_by_request(run).values()}


def _fault(url: str, **spec: Any) -> None:
    httpx.post(f"{url}/_fault", json=spec, timeout=30).raise_for_status()


def _journal_ok(run: RunFolder) -> list[dict[str, Any]]:
    """Every ok record of every shard's journal, duplicates included."""
    plan = run.read_json("prompts/shards.json")["shards"]
    return [
        rec
        for shard in plan
        for rec in read_journal(run, "generate", shard["shard_id"]).records
        if rec.get("status") == "ok"
    ]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory, tiny_target_dir, server) -> EagleScaleConfig:
    """Run A, complete: the chat and reasoning samples (first-turn prompts, say)."""
    cfg = _config(
        tmp_path_factory.mktemp("earlier"), tiny_target_dir, server.url, CHAT_AND_REASONING
    )
    _generate(_stage(cfg))
    assert ShardStore(RunFolder(cfg.run_root), "generate").is_complete()
    return cfg


def test_a_grown_run_sends_only_its_new_prompts_and_commits_the_earlier_replies(
    tmp_path, tiny_target_dir, server, earlier
):
    a = RunFolder(earlier.run_root)
    a_fp = a.read_json("run.json")["fingerprint_hash"]
    a_rows = {(r["prompt_id"], r["sample_index"]): r for r in rows_by_request(a).values()}
    cfg = _config(
        tmp_path,
        tiny_target_dir,
        server.url,
        [*CHAT_AND_REASONING, CODING],
        reuse_from=earlier.run_root,
    )
    stage = _stage(cfg)
    b = stage.run
    shared = _keys(b) & set(a_rows)
    new = _keys(b) - shared
    assert len(shared) >= 150 and len(new) >= 80  # a superset: A's prompts and the coding ones

    before = _sent(server.url)
    summary = _generate(stage)
    sent = _sent(server.url) - before

    assert sent == len(new)
    assert assert_exactly_once(b) == (len(shared) + len(new), 0)
    assert ShardStore(b, "generate").is_complete()
    for row in rows_by_request(b).values():
        key = (row["prompt_id"], row["sample_index"])
        if key in shared:  # A's reply, under B's request id, saying where it came from
            assert (row["output_ids"], row["text"]) == (
                a_rows[key]["output_ids"],
                a_rows[key]["text"],
            )
            assert row["attempt"].startswith(f"reused-{a_fp}-"), row["attempt"]
            assert row["finish_reason"] == a_rows[key]["finish_reason"]
        else:
            assert not row["attempt"].startswith("reused-") and row["server"] == server.url
    journaled = Counter(
        rec["request_id"] for rec in _journal_ok(b) if rec["attempt"].startswith("reused-")
    )
    assert len(journaled) == len(shared) and set(journaled.values()) == {1}

    # The accounting: reused requests are done, never sent, and say where they came from.
    assert (summary["reused"], summary["reused_from"]) == (len(shared), earlier.run_root)
    assert (summary["requests_sent"], summary["sent_per_request"]) == (len(new), 1.0)
    assert sum(m["reused"] for m in ShardStore(b, "generate").committed().values()) == len(shared)
    progress = b.read_json(GENERATE_PROGRESS)
    assert progress["reused"] == {"requests": len(shared), "from": earlier.run_root}
    requests = progress["requests"]
    assert (requests["done"], requests["done_this_run"]) == (len(shared) + len(new), len(new))
    assert (requests["sent"], requests["sent_this_run"], requests["sent_per_request"]) == (
        len(new),
        len(new),
        1.0,
    )

    # A later process on the finished run reads the same counts from the markers, sending nothing.
    again = _stage(cfg)
    assert again.prepare() == []
    assert again.progress.snapshot()["reused"]["requests"] == len(shared)
    assert again.summary()["reused"] == len(shared)
    again.engine.close()
    assert _sent(server.url) - before == len(new)


def test_a_stop_and_a_resume_journal_nothing_twice_and_resend_nothing_held(
    tmp_path, tiny_target_dir, server, earlier
):
    a_keys = _committed_keys(RunFolder(earlier.run_root))
    cfg = _config(
        tmp_path,
        tiny_target_dir,
        server.url,
        [*CHAT_AND_REASONING, CODING],
        reuse_from=earlier.run_root,
    )
    stage = _stage(cfg)
    b = stage.run
    pending = stage.prepare()
    assert len(pending) >= 4
    # The first shard is committed; the second is stopped with some of its new requests
    # journaled and others held at the server (every other one answers 30 s late).
    assert stage.run_shard(pending[0]).status == "committed"
    errors: list[BaseException] = []

    def second() -> None:
        try:
            stage.run_shard(pending[1])
        except BaseException as e:  # asserted below
            errors.append(e)

    def generated_in_second() -> int:
        records = read_journal(b, "generate", pending[1]).records
        return sum(r["status"] == "ok" and not r["attempt"].startswith("reused-") for r in records)

    _fault(server.url, mode="slow", delay_s=30.0, rate=0.5, seed=3)
    try:
        worker = threading.Thread(target=second)
        worker.start()
        deadline = time.monotonic() + 60
        while generated_in_second() == 0:
            assert time.monotonic() < deadline and worker.is_alive(), (
                "the second shard journaled nothing"
            )
            time.sleep(0.01)
        stage.stop()
        worker.join(timeout=60)
        stage.close()
    finally:
        _fault(server.url, mode="none")
    assert len(errors) == 1 and isinstance(errors[0], ShardStopped), errors
    assert set(ShardStore(b, "generate").committed()) == {pending[0]}

    # The stopped shard's reused replies were journaled before it sent anything.
    plan = b.read_json("prompts/shards.json")["shards"]
    spec = next(s for s in plan if s["shard_id"] == pending[1])
    ours = {
        k for k in _keys(b) & a_keys if spec["first_prompt_id"] <= k[0] <= spec["last_prompt_id"]
    }
    stopped = read_journal(b, "generate", pending[1]).records
    assert sum(rec["attempt"].startswith("reused-") for rec in stopped) == len(ours) > 0

    held = {rec["request_id"] for rec in _journal_ok(b)}
    fp_hash = b.read_json("run.json")["fingerprint_hash"]
    planned = planned_requests(sorted({p for p, _ in _keys(b)}), fp_hash, 1)
    to_send = [
        p
        for p in planned
        if p.request_id not in held and (p.prompt_id, p.sample_index) not in a_keys
    ]
    assert 0 < len(to_send) < len(_keys(b) - a_keys)

    resumed = _stage(cfg)
    before = _sent(server.url)
    summary = _generate(resumed)
    assert _sent(server.url) - before == len(to_send)  # nothing journaled or reusable was sent

    ok = Counter(rec["request_id"] for rec in _journal_ok(b))
    assert set(ok.values()) == {1}, "a request was journaled twice"
    shared = _keys(b) & a_keys
    assert sum(rec["attempt"].startswith("reused-") for rec in _journal_ok(b)) == len(shared)
    assert assert_exactly_once(b) == (len(_keys(b)), 0)
    assert (
        summary["reused"] == len(shared) and summary["shards_committed"] == summary["shards_total"]
    )


def _nothing_under_generate(run_root: str) -> bool:
    folder = Path(run_root) / "generate"
    return not folder.exists() or not any(folder.rglob("*"))


def test_an_earlier_run_of_another_sampling_or_target_is_refused_before_any_request(
    tmp_path, tiny_target_dir, server
):
    a = _config(tmp_path / "a", tiny_target_dir, server.url, CHAT_AND_REASONING[:1], shard_size=200)
    _generate(_stage(a))
    other_target = build_tiny_target(tmp_path / "other-target", seed=1)
    cases = {
        "sampling": (tiny_target_dir, ["sampling.max_new_tokens: 8 -> 16"]),
        "both": (other_target, ["sampling.max_new_tokens: 8 -> 16", "target.revision: 'sha256:"]),
    }
    for name, (model_dir, named) in cases.items():
        cfg = _config(tmp_path / name, model_dir, server.url, [*CHAT_AND_REASONING, CODING], max_new_tokens=16,
                      reuse_from=a.run_root)  # fmt: skip
        stage = _stage(cfg)
        before = _sent(server.url)
        with pytest.raises(FingerprintMismatch) as refused:
            stage.prepare()
        stage.engine.close()
        message = str(refused.value)
        assert message.startswith(
            f"generate.reuse_from: {a.run_root} was generated with another target or sampling"
        )
        for field in named:
            assert f"\n  {field}" in message, message
        assert ("target." in message) == (name == "both"), message
        assert _sent(server.url) == before
        assert _nothing_under_generate(cfg.run_root), list(
            (Path(cfg.run_root) / "generate").rglob("*")
        )


def test_a_folder_that_is_no_run_or_holds_no_committed_generation_is_refused(
    tmp_path, tiny_target_dir, server
):
    empty = tmp_path / "empty"
    empty.mkdir()
    discovered = _config(
        tmp_path / "discovered", tiny_target_dir, server.url, CHAT_AND_REASONING[:1]
    )
    discover_and_fingerprint(discovered)  # run.json, and no generation
    cases = {
        str(tmp_path / "nowhere"): "no run folder there",
        str(empty): "no run.json: not a run root whose generation has started",
        discovered.run_root: "no committed generation shard (generate/_SUCCESS/ is empty or missing)",
    }
    for i, (where, why) in enumerate(cases.items()):
        cfg = _config(
            tmp_path / f"b{i}",
            tiny_target_dir,
            server.url,
            CHAT_AND_REASONING[:1],
            reuse_from=where,
        )
        stage = _stage(cfg)
        before = _sent(server.url)
        with pytest.raises(ConfigError) as refused:
            stage.prepare()
        stage.engine.close()
        assert str(refused.value) == f"generate.reuse_from: {where}: {why}; nothing was sent"
        assert _sent(server.url) == before and _nothing_under_generate(cfg.run_root)
    assert not (tmp_path / "nowhere").exists()  # looking did not create it


def test_the_input_check_wants_the_earlier_run_folder_where_generation_runs(
    tmp_path, tiny_target_dir
):
    a_file = tmp_path / "run.tar"
    a_file.write_bytes(b"x")
    params = write_params(tmp_path, tiny_target_dir, str(tmp_path / "run"))
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as refused:
        check_input_paths(load_config(params, [f"generate.reuse_from={missing}"]))
    assert f"generate.reuse_from: no earlier run folder at {missing}" in str(refused.value)
    with pytest.raises(
        ConfigError, match=f"generate.reuse_from: {a_file} is a file, not a run folder"
    ):
        check_input_paths(load_config(params, [f"generate.reuse_from={a_file}"]))
    # Not read by this process: no check.
    check_input_paths(load_config(params, [f"generate.reuse_from={missing}", "stages=[discover]"]))
    check_input_paths(load_config(params, [f"generate.reuse_from={missing}",
                                           "orchestration.stage_deployments={generate: generate/gpu}"]))  # fmt: skip
    check_input_paths(load_config(params, [f"generate.reuse_from={tmp_path}"]))
