"""The real CLI on the embedded default (ephemeral Prefect API): run, resume, refuse, fail.

Slack goes to a local receiver through the incoming-webhook path, as in production.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tasks.runfolder import RunFolder, ShardStore
from tasks.status.read import read_status
from tests.run_support import assert_exactly_once, cli_env, start_cli, write_params
from tests.slack_support import Receiver, message_texts, title, unreadable

# The smoke profile's stages, in order.
STAGES = yaml.safe_load((Path(__file__).resolve().parents[1] / "deployments/params/smoke.yaml").read_text())["stages"]


def _texts(receiver: Receiver) -> list[str]:
    return [json.dumps(r["json"]) for r in receiver.requests]


def _run(args: list[str], env: dict[str, str], log) -> int:
    return start_cli(args, env, log).wait(timeout=600)


def test_smoke_run_resume_and_refused_fingerprint(tmp_path, tiny_target_dir, capsys):
    run_dir = tmp_path / "run"
    params = write_params(tmp_path, tiny_target_dir, str(run_dir), sampling={"max_new_tokens": 16})
    log = tmp_path / "cli.log"
    with Receiver() as slack:
        # INFO: the run's log file gets the flow runs' lines too (the terminal shows them anyway).
        env = cli_env(tmp_path, SLACK_WEBHOOK_URL=f"{slack.url}/services/T000/B000/XXXSECRET", PREFECT_LOGGING_LEVEL="INFO")
        assert _run(["run", "--params", str(params)], env, log) == 0, log.read_text()[-3000:]
        assert "Loading weights" not in log.read_text()  # no progress bar per model load

        run = RunFolder(str(run_dir))
        rows, dead = assert_exactly_once(run)
        assert rows == 276 and dead == 0  # the shipped sample set, after dedupe and holdout
        store = ShardStore(run, "generate")
        assert store.is_complete()
        before = {s: m["attempt"] for s, m in store.committed().items()}
        texts = _texts(slack)
        _stage_by_stage([r["json"] for r in slack.requests])
        assert any("rows" in t and "276" in t for t in texts)
        # Each stage's clock, as `eaglescale status --json` shows it: one after another.
        clocks = read_status(run)["stages"]
        assert list(clocks) == STAGES
        assert all(c["state"] == "completed" and c["attempts"] == 1 and c["started_at"] <= c["ended_at"] for c in clocks.values())
        assert all(clocks[a]["ended_at"] <= clocks[b]["started_at"] for a, b in zip(STAGES, STAGES[1:], strict=False))

        # Resume on the same run root: discovery is skipped, no shard is run again.
        assert _run(["run", "--params", str(params)], env, log) == 0, log.read_text()[-3000:]
        assert {s: m["attempt"] for s, m in store.committed().items()} == before
        # Every stage found its work done: each keeps the times of the run that did it, and
        # none announces a completion.
        assert read_status(run)["stages"] == clocks
        assert not any("completed" in t for t in _texts(slack)[len(texts):])
        # Generation's own start message says it has nothing to run (extraction's "shards to run: 0"
        # must not pass for it).
        resumed = [t for t in _texts(slack) if "generate started" in t]
        assert len(resumed) == 2 and "to run: 0" in resumed[-1] and "to run: 0" not in resumed[0], resumed

        # A changed sampling parameter is refused, naming the field.
        args = ["run", "--params", str(params), "--set", "sampling.max_new_tokens=8"]
        assert _run(args, env, log) == 1
        assert "sampling.max_new_tokens: 16 -> 8" in log.read_text()
        assert {s: m["attempt"] for s, m in store.committed().items()} == before
        assert "XXXSECRET" not in log.read_text()

    # The run folder's log files: one per process, each with the run's own lines, none a page long.
    files = sorted((run_dir / "logs").iterdir())
    assert len(files) == 3, files
    first_log = files[0].read_text()
    assert "Created subflow run" in first_log or "Finished in state Completed" in first_log
    assert "generate: 7 shards planned, 7 to run" in first_log and "already done" in files[1].read_text()
    assert "sampling.max_new_tokens: 16 -> 8" in files[2].read_text()
    assert max(len(line) for f in files for line in f.read_text().splitlines() if "Traceback" not in line) < 1000
    assert not any("XXXSECRET" in f.read_text() for f in files)

    _exported_and_verified(tmp_path, run_dir, capsys)


def _stage_by_stage(posts: list[dict]) -> None:
    """One readable message per stage event, in the pipeline's order: each stage started, then
    completed; the gate's completion is its decision. None holds a repr or a float of more than
    6 significant digits."""
    titles = [title(m) for m in posts]
    expected = [f"{stage} {event}" for stage in STAGES for event in ("started", "completed")]
    assert titles[:-1] == expected[:-1] and re.fullmatch(r"gate: (PROMOTE|REJECT|STOPPED)", titles[-1]), titles
    assert [p for m in posts for p in unreadable(m)] == []
    generated = next(m for m in posts if title(m) == "generate completed")
    # Its headline says it in one line; the fields hold the rest.
    assert re.search(r"in \d+(m \d\ds|s); 276 rows in 7 / 7 shards, [\d,]+ tokens, 0 dead letters", message_texts(generated)[1])


def _exported_and_verified(tmp_path: Path, run_dir: Path, capsys) -> None:
    """The finished run as other tools take it: its dataset as JSONL conversations, and a
    verify that passes, then names each damaged file with its fix."""
    from tasks.generate.dataset_export import export_data_main
    from tasks.runfolder.verify import verify_main
    from tests.run_support import rows_by_request

    out = tmp_path / "regenerated.jsonl"
    assert export_data_main([str(run_dir), str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    rows = rows_by_request(RunFolder(str(run_dir)))
    assert len(lines) == len(rows) == 276
    for line in lines:
        turns = line["conversations"]
        assert turns[-1] == {"role": "assistant", "content": rows[line["id"]]["text"]}
        assert turns[0]["role"] in ("system", "user") and all(set(t) == {"role", "content"} for t in turns)

    assert verify_main([str(run_dir)]) == 0
    store = ShardStore(RunFolder(str(run_dir)), "generate")
    shard = sorted(store.committed().values(), key=lambda m: m["shard_id"])[0]
    data = run_dir / shard["data"]
    flipped = bytearray(data.read_bytes())
    flipped[len(flipped) // 2] ^= 1
    data.write_bytes(bytes(flipped))
    part = run_dir / ShardStore(RunFolder(str(run_dir)), "extract").committed()[shard["shard_id"]]["parts"][0]["path"]
    part.write_bytes(part.read_bytes()[:-64])
    final = run_dir / "train/final/model.safetensors"
    final.write_bytes(final.read_bytes()[:-64])
    (run_dir / "prompts/shards.json").write_text('{"shards": [')
    capsys.readouterr()
    assert verify_main([str(run_dir)]) == 1
    report = capsys.readouterr().out
    for rel, fix in (
        (shard["data"], f"delete generate/_SUCCESS/{shard['shard_id']}.json and resume"),
        (str(part.relative_to(run_dir)), f"delete extract/_SUCCESS/{shard['shard_id']}.json and resume"),
        ("train/final/model.safetensors", "resume with the train stage"),
        ("prompts/shards.json", "not valid JSON"),
    ):
        assert rel in report and fix in report, (rel, report)


def test_failed_stage_exits_nonzero_and_reaches_slack(tmp_path, tiny_target_dir):
    run_dir = tmp_path / "run"
    params = write_params(
        tmp_path,
        tiny_target_dir,
        str(run_dir),
        engine={"kind": "sglang", "endpoints": ["http://127.0.0.1:9"], "health_recheck_s": 0.5},
        generate={"shard_retries": 0, "shard_size": 400},
    )
    log = tmp_path / "cli.log"
    with Receiver() as slack:
        env = cli_env(tmp_path, SLACK_WEBHOOK_URL=f"{slack.url}/services/T000/B000/XXXSECRET")
        assert _run(["run", "--params", str(params)], env, log) == 1
        texts = _texts(slack)
        assert any("generate FAILED" in t and "Cannot connect" in t for t in texts), texts
        # The failing stage had said it started; the parent's failure comes last.
        posts = [r["json"] for r in slack.requests]
        assert [title(m) for m in posts] == ["discover started", "discover completed", "generate started",
                                             "generate FAILED", "data-scaling FAILED"]  # fmt: skip
        assert [p for m in posts for p in unreadable(m)] == []
    # Nothing half-written counts: no shard is marked, the prompts stay committed.
    run = RunFolder(str(run_dir))
    assert ShardStore(run, "generate").committed() == {}
    assert run.exists("prompts/_SUCCESS.json")
    assert "XXXSECRET" not in log.read_text()
    clocks = read_status(run)["stages"]
    assert clocks["discover"]["state"] == "completed"
    assert clocks["generate"]["state"] == "failed" and clocks["generate"]["ended_at"] >= clocks["generate"]["started_at"]
    assert clocks["generate"]["error"] and "extract" not in clocks  # what failed, and nothing after it began


def test_stalled_generation_alerts_slack_then_recovers(tmp_path, tiny_target_dir):
    """Every first request hangs past the stall bound: Slack hears 'stalled', then the timeouts
    fire, the requests are retried and the run still completes."""
    from tasks.standins.server import ServerProcess

    server = ServerProcess(["--model", str(tiny_target_dir), "--fault", "hang", "--fault-count", "4"])
    try:
        run_dir = tmp_path / "run"
        params = write_params(
            tmp_path,
            tiny_target_dir,
            str(run_dir),
            sampling={"max_new_tokens": 8},
            discover={"total_prompts": 24},
            engine={
                "kind": "sglang", "endpoints": [server.url], "concurrency_per_server": 4,
                "request_timeout_s": 8, "backoff_base_s": 0.05, "health_recheck_s": 30,
            },
            generate={"stall_after_s": 3, "progress_interval_s": 1},
        )
        log = tmp_path / "cli.log"
        with Receiver() as slack:
            env = cli_env(tmp_path, SLACK_WEBHOOK_URL=f"{slack.url}/services/T000/B000/XXXSECRET")
            assert _run(["run", "--params", str(params)], env, log) == 0, log.read_text()[-3000:]
            texts = _texts(slack)
        assert any("generate looks stalled" in t for t in texts), texts
        # The alert carries the figures a watcher checks first (tasks/status/figures.py).
        stalled = next(r["json"] for r in slack.requests if title(r["json"]) == "generate looks stalled")
        assert all(f"*{label}*" in " ".join(message_texts(stalled)) for label in ("requests", "rate", "servers"))
        assert unreadable(stalled) == []
        assert any("generate completed" in t for t in texts), texts
        rows, dead = assert_exactly_once(RunFolder(str(run_dir)))
        assert (rows, dead) == (24, 0)
    finally:
        server.stop()
