"""The generate stage on the `sglang` engine over real HTTP, against two SGLang-compatible
servers serving the tiny target: injected faults, one server killed mid-run, context
overflows. The stage completes with every planned request exactly once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest

from tasks.config import load_config
from tasks.engines.base import WrongModel
from tasks.engines.sglang_client import SGLangEngine
from tasks.generate.stage import GenerateStage
from tasks.runfolder import ShardStore
from tasks.runfolder.layout import GENERATE_PROGRESS
from tasks.standins.server import ServerProcess, start_server_thread
from tests.run_support import assert_exactly_once, discover_and_fingerprint, write_params


def _stage(tmp_path, model_dir, endpoints, engine=None, **generate) -> GenerateStage:
    params = write_params(
        tmp_path,
        model_dir,
        str(tmp_path / "run"),
        sampling={"max_new_tokens": 16},
        engine={
            "kind": "sglang",
            "endpoints": endpoints,
            "concurrency_per_server": 8,
            "request_timeout_s": 60,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            "health_recheck_s": 0.5,
            **(engine or {}),
        },
        generate={"shard_size": 40, "max_dead_fraction": 0.6, **generate},
        discover={"total_prompts": 120},
    )
    cfg = load_config(params)
    run, tokenizer, fp_hash = discover_and_fingerprint(cfg)
    return GenerateStage(cfg, run, fp_hash, SGLangEngine(cfg.engine), tokenizer)


@pytest.fixture
def two_servers(tiny_target_dir):
    # Context 160 tokens with 16 new tokens: the longer coding prompts overflow on purpose.
    common = ["--model", str(tiny_target_dir), "--context-length", "160"]
    flaky = ServerProcess([*common, "--fault", "5xx", "--fault-rate", "0.3", "--fault-seed", "7"])
    steady = ServerProcess(common)
    try:
        yield flaky, steady
    finally:
        flaky.stop()
        steady.stop()


def test_faults_failover_and_dead_letters(tmp_path, tiny_target_dir, two_servers):
    flaky, steady = two_servers
    stage = _stage(tmp_path, tiny_target_dir, [flaky.url, steady.url])
    pending = stage.prepare()
    assert len(pending) == 3
    first = stage.run_shard(pending[0])
    assert first.status == "committed"

    # The flaky server dies mid-run (SIGKILL): its requests must finish on the other one.
    httpx.post(f"{flaky.url}/_fault", json={"mode": "reset", "rate": 1.0})
    flaky.kill()
    for shard_id in pending[1:]:
        assert stage.run_shard(shard_id).status == "committed"
    summary = stage.finish()
    stage.engine.close()

    run = stage.run
    rows, dead = assert_exactly_once(run)
    assert rows + dead == 120 and rows > 0
    assert ShardStore(run, "generate").is_complete()
    assert set(summary["dead_classes"]) == {"context_overflow"}
    store = ShardStore(run, "generate")
    messages = [
        msg for m in store.committed().values() for msg in store.read_dead(m).column("message").to_pylist()
    ]
    assert messages and all("context length" in msg for msg in messages)
    servers = Counter(
        srv for m in store.committed().values() for srv in store.read_rows(m).column("server").to_pylist()
    )
    assert servers[steady.url] > 0
    health = {h.url: h for h in stage.engine.health()}
    assert health[flaky.url].healthy is False


def _sent(url: str) -> int:
    return httpx.get(f"{url}/_stats").json()["generate_requests"]


def test_requests_sent_are_counted_and_no_answer_is_generated_twice(tmp_path, tiny_target_dir):
    """b fails three new requests mid-run and leaves rotation while it generates others: the
    stage commits every request once, and the only requests sent twice are the three failures,
    as the summary, the markers and progress.json all report."""
    args = ["--simulate", "--step-latency-ms", "20"]
    with ServerProcess(args) as a, ServerProcess(args) as b:
        stage = _stage(tmp_path, tiny_target_dir, [a.url, b.url], engine={"unhealthy_after": 2})
        pending = stage.prepare()
        assert stage.run_shard(pending[0]).sent == 40
        httpx.post(f"{b.url}/_fault", json={"mode": "5xx", "count": 3})
        outcomes = [stage.run_shard(s) for s in pending[1:]]
        summary = stage.finish()
        stage.engine.close()
        sent = _sent(a.url) + _sent(b.url)
        assert httpx.get(f"{b.url}/_stats").json()["faults"]["injected"] == 3
    assert assert_exactly_once(stage.run) == (120, 0)
    assert sent == 120 + 3
    assert sum(o.sent for o in outcomes) == 80 + 3
    assert (summary["requests_sent"], summary["sent_per_request"]) == (123, round(123 / 120, 4))
    markers = ShardStore(stage.run, "generate").committed().values()
    assert sum(m["requests_sent"] for m in markers) == 123
    servers = Counter()
    for m in markers:
        servers.update(m["servers"])
    assert set(servers) == {a.url, b.url} and sum(servers.values()) == 120
    progress = stage.run.read_json(GENERATE_PROGRESS)["requests"]
    assert (progress["sent"], progress["sent_per_request"]) == (123, 123 / 120)

    # A later process on the finished run root reads the same counts from the markers.
    again = _stage(tmp_path, tiny_target_dir, [a.url], engine={"unhealthy_after": 2})
    assert again.prepare() == []
    assert again.progress.snapshot()["requests"]["sent"] == 123
    assert again.summary()["requests_sent"] == 123
    again.engine.close()


def test_dead_fraction_over_bound_fails_loudly_and_keeps_journal(tmp_path, tiny_target_dir, two_servers):
    _, steady = two_servers
    stage = _stage(tmp_path, tiny_target_dir, [steady.url], max_dead_fraction=0.0)
    pending = stage.prepare()
    failures = 0
    for shard_id in pending:
        try:
            stage.run_shard(shard_id)
        except RuntimeError as e:
            failures += 1
            assert "max_dead_fraction" in str(e) and "context_overflow" in str(e)
    stage.engine.close()
    assert failures >= 1
    store = ShardStore(stage.run, "generate")
    # A failed shard is not committed, but its successes are journaled for the rerun.
    failed = [s for s in pending if s not in store.committed()]
    journal = stage.run.listdir(f"generate/journal/{failed[0]}")
    assert journal


def test_retry_dead_reruns_only_dead_letters(tmp_path, tiny_target_dir):
    """Context overflows on a short-context server are dead letters; after the operator moves to
    a server with room, retry_dead reruns exactly those keys and re-commits the shards."""
    short = ServerProcess(["--model", str(tiny_target_dir), "--context-length", "160"])
    try:
        stage = _stage(tmp_path, tiny_target_dir, [short.url])
        for shard_id in stage.prepare():
            stage.run_shard(shard_id)
        stage.engine.close()
    finally:
        short.stop()
    store = ShardStore(stage.run, "generate")
    before = {s: store.read_rows(m).to_pylist() for s, m in store.committed().items()}
    dead_before = sum(m["dead"] for m in store.committed().values())
    assert dead_before > 0

    roomy = ServerProcess(["--model", str(tiny_target_dir)])
    try:
        retry = _stage(tmp_path, tiny_target_dir, [roomy.url], retry_dead=True)
        pending = retry.prepare()
        assert set(pending) == {s for s, m in store.committed().items() if m["dead"]}
        outcomes = [retry.run_shard(s) for s in pending]
        retry.engine.close()
    finally:
        roomy.stop()
    assert sum(o.new_requests for o in outcomes) == dead_before
    rows, dead = assert_exactly_once(stage.run)
    assert (rows, dead) == (120, 0)
    # Rows committed before the retry are kept as they were, not regenerated.
    after = {s: {r["request_id"]: r for r in store.read_rows(m).to_pylist()} for s, m in store.committed().items()}
    for shard_id, old_rows in before.items():
        for row in old_rows:
            assert after[shard_id][row["request_id"]]["output_ids"] == row["output_ids"]


def test_ids_only_answers_get_their_text_from_the_targets_tokenizer(tmp_path, tiny_target_dir):
    """A server started with --skip-tokenizer-init answers without "text": the rows still hold
    the reply's text (decoded here), and no row is flagged empty."""
    server = ServerProcess(["--model", str(tiny_target_dir), "--skip-tokenizer-init"])
    try:
        body = httpx.post(f"{server.url}/generate", json={"input_ids": [5, 6, 7]}, timeout=30).json()
        assert "text" not in body and body["output_ids"]
        stage = _stage(tmp_path, tiny_target_dir, [server.url], shard_size=200)
        shard_id = stage.prepare()[0]
        outcome = stage.run_shard(shard_id)
    finally:
        server.stop()
    rows = ShardStore(stage.run, "generate").read_rows(outcome.marker).to_pylist()
    nonempty = [r for r in rows if r["output_ids"]]
    assert nonempty and all(
        r["text"] == stage.tokenizer.decode(r["output_ids"], skip_special_tokens=True) for r in nonempty
    )
    assert outcome.marker["quality"]["empty_output"] == sum(1 for r in rows if not r["text"].strip())
    assert outcome.marker["quality"]["empty_output"] < len(rows) // 2


def test_a_server_of_another_model_is_stopped_at_the_door_or_at_its_first_answer(tmp_path, tiny_target_dir):
    """SGLang reports no vocabulary size, so a server of another model passes the door unless
    its context cannot hold the run; its first answer with an id outside the target's
    vocabulary then stops the shard before anything of that answer is journaled."""
    for name in ("short", "other"):
        (tmp_path / name).mkdir()
    with start_server_thread(step_latency_s=0.0, vocab_size=50000) as other, \
            start_server_thread(step_latency_s=0.0, vocab_size=2048, context_length=48) as short:  # fmt: skip
        # Context 48 with 16 new tokens: most prompts cannot fit, far over max_dead_fraction.
        door = _stage(tmp_path / "short", tiny_target_dir, [short.url], max_dead_fraction=0.05)
        with pytest.raises(WrongModel) as refused:
            door.check_servers()
        door.engine.close()
        assert short.server.requests.get("generate", 0) == 0

        stage = _stage(tmp_path / "other", tiny_target_dir, [other.url])
        notes = stage.check_servers()  # the path differs, which alone proves nothing
        assert any("serves 'simulated'" in n for n in notes), notes
        shard_id = stage.prepare()[0]
        with pytest.raises(WrongModel) as stopped:
            stage.run_shard(shard_id)
        stage.engine.close()
    message = str(refused.value)
    assert message.startswith(f"{short.url} cannot serve this run: context length 48 tokens")
    assert "sampling.max_new_tokens (16)" in message and "generate.max_dead_fraction (5.0%)" in message
    message = str(stopped.value)
    assert message.startswith(f"{other.url} answered token id ") and "outside the target's vocabulary of 2048" in message
    assert ShardStore(stage.run, "generate").committed() == {}
    journal = stage.run.path(f"generate/journal/{shard_id}")
    assert sum(p.read_text().count("\n") for p in Path(journal).rglob("*.jsonl")) == 0
