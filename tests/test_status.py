"""`eaglescale status` on run folders constructed in tmp_path (no Prefect, no live process)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from tasks.notify import format_duration
from tasks.status.command import EXIT_MISSING, EXIT_OK, EXIT_STALLED, status_main
from tasks.status.read import open_run, read_status
from tasks.status.render import render_status

NOW = 1_700_000_000.0
ROOT = Path(__file__).resolve().parents[1]


def _write(root: Path, rel: str, obj: Any) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _marker(
    shard_id: str, rows: int, dead: int, ptok: int, ctok: int, classes: dict[str, int]
) -> dict[str, Any]:
    return {
        "shard_id": shard_id, "data": f"generate/data/{shard_id}.a1.parquet", "sha256": "0" * 64,
        "rows": rows, "dead": dead, "dead_path": f"generate/dead/{shard_id}.a1.parquet",
        "dead_sha256": "0" * 64, "fingerprint": "fp", "prompt_tokens": ptok,
        "completion_tokens": ctok, "committed_at": NOW - 500, "attempt": "a1",
        "dead_classes": classes,
    }  # fmt: skip


def make_run(root: Path, heartbeat_age: float = 10.0, progress: bool = True) -> Path:
    """A run mid-generate: 5 shards of 10 prompts x 2 samples; 2 committed, 1 running, 1 failed."""
    _write(root, "run.json", {
        "fingerprint": {
            "target": {"model_path": "/models/tiny", "revision": "abc123"},
            "sampling": {"temperature": 0.0, "max_new_tokens": 64, "samples_per_prompt": 2},
            "code_version": "0.1.0", "manifest_hash": "m" * 16,
        },
        "fingerprint_hash": "f00dfeedcafe0001", "created_at": NOW - 3600,
    })  # fmt: skip
    _write(root, "prompts/_SUCCESS.json", {
        "config_hash": "c", "manifest_hash": "m" * 16, "committed_at": NOW - 3000,
        "files": {"manifest": {"rows": 50}, "holdout": {"rows": 6}, "quarantine": {"rows": 3}},
    })  # fmt: skip
    _write(
        root,
        "prompts/discovery_report.json",
        {"totals": {"rows_read": 59, "kept": 50}, "warnings": ["w"]},
    )
    shard_ids = [f"s{i:05d}-abcd" for i in range(5)]
    _write(root, "prompts/shards.json", {
        "manifest_hash": "m" * 16, "shard_size": 10,
        "shards": [
            {"shard_id": s, "first_prompt_id": f"{i}a", "last_prompt_id": f"{i}z", "n_prompts": 10}
            for i, s in enumerate(shard_ids)
        ],
    })  # fmt: skip
    _write(
        root,
        f"generate/_SUCCESS/{shard_ids[0]}.json",
        _marker(shard_ids[0], 19, 1, 1000, 1200, {"http_400": 1}),
    )
    _write(
        root, f"generate/_SUCCESS/{shard_ids[1]}.json", _marker(shard_ids[1], 20, 0, 900, 1100, {})
    )
    if progress:
        hb = NOW - heartbeat_age
        _write(root, "generate/progress.json", {
            "updated_at": hb, "heartbeat_at": hb, "last_progress_at": hb - 1, "started_at": NOW - 2000,
            "stall_after_s": 900.0, "state": "running",
            "requests": {"done": 47, "total": 100, "dead": 1},
            "tokens": {"prompt_done": 2300, "completion_done": 2600, "completion_total_estimate": 5500},
            "rate": {"lifetime_tokens_per_s": 1.3, "window_tokens_per_s": 2.5, "window_s": 300.0,
                     "requests_per_s": 0.02},
            "eta_s": 1160.0, "eta_at": hb + 1160.0, "percent": 47.0,
            "shards": {
                shard_ids[0]: {"state": "committed", "requests": 20, "done": 20},
                shard_ids[1]: {"state": "committed", "requests": 20, "done": 20},
                shard_ids[2]: {"state": "running", "requests": 20, "done": 5},
                shard_ids[3]: {"state": "failed", "requests": 20, "done": 2, "error": "EngineUnavailable: no server"},
            },
            "servers": [{"url": "http://10.0.0.1:30000", "healthy": True, "in_flight": 3, "completed": 40,
                         "failures": 0, "consecutive_failures": 0, "last_error": "", "extra": {}}],
        })  # fmt: skip
    return root


def test_read_status_counts(tmp_path: Path) -> None:
    run = open_run(str(make_run(tmp_path / "run")))
    status = read_status(run, now=NOW)
    gen = status["generate"]
    assert status["stalled"] is False
    assert gen["state"] == "running"
    assert gen["shards"] == {
        "planned": 5,
        "committed": 2,
        "by_state": {"committed": 2, "running": 1, "failed": 1, "pending": 1},
    }
    # committed: 20 + 20 (markers), running 5, failed 2, pending 0; total 5 x 10 x 2
    assert gen["requests"] == {"done": 47, "total": 100, "dead": 1}
    assert gen["percent"] == 47.0
    assert gen["committed"] == {
        "rows": 39,
        "prompt_tokens": 1900,
        "completion_tokens": 2300,
        "dead_classes": {"http_400": 1},
        # markers from before sends and servers were counted: one send each, no server split
        "requests_sent": 40,
        "sent_per_request": 1.0,
        "reused": 0,  # none taken from an earlier run (generate.reuse_from)
        "per_server": None,
    }
    assert gen["overall"] is None  # not complete
    assert gen["shard_items"]["s00003-abcd"]["error"] == "EngineUnavailable: no server"
    assert gen["progress"]["heartbeat_age_s"] == 10.0
    assert status["discover"] == {
        "committed": True,
        "committed_at": NOW - 3000,
        "manifest_rows": 50,
        "holdout_rows": 6,
        "quarantine_rows": 3,
        "totals": {"rows_read": 59, "kept": 50},
        "warnings": 1,
    }
    assert status["run"]["fingerprint"]["target.revision"] == "abc123"
    assert status["run"]["fingerprint_hash"] == "f00dfeedcafe0001"


def test_json_output_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_run(tmp_path / "run", heartbeat_age=5.0)
    # the real clock is far from NOW, so give a bound larger than the constructed ages
    age = time.time() - NOW
    rc = status_main([str(root), "--json", "--stall-after", str(age + 3600)])
    out = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK
    assert out["generate"]["requests"] == {"done": 47, "total": 100, "dead": 1}
    assert out["generate"]["shards"]["by_state"] == {
        "committed": 2,
        "running": 1,
        "failed": 1,
        "pending": 1,
    }
    assert out["stalled"] is False


def test_old_heartbeat_is_stalled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_run(tmp_path / "run", heartbeat_age=1000.0)
    status = read_status(open_run(str(root)), now=NOW)
    assert status["stalled"] is True
    assert status["generate"]["state"] == "stalled"
    assert status["generate"]["stall_reason"] == (
        "no heartbeat for 16m 40s (the generating process is gone or hung)"
    )
    # a wider bound given on the command line wins over progress.json's own
    assert read_status(open_run(str(root)), now=NOW, stall_after_s=2000)["stalled"] is False
    # the CLI (real clock, long after NOW) reports the stall with exit code 3
    assert status_main([str(root), "--json"]) == EXIT_STALLED
    assert json.loads(capsys.readouterr().out)["generate"]["state"] == "stalled"


def test_live_heartbeat_without_results_is_stalled(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run")
    progress = json.loads((root / "generate/progress.json").read_text())
    progress["last_progress_at"] = NOW - 901
    (root / "generate/progress.json").write_text(json.dumps(progress))
    status = read_status(open_run(str(root)), now=NOW)
    assert status["generate"]["stall_reason"] == "no request finished for 15m 01s"


def test_complete_is_never_stalled(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run", heartbeat_age=99_999.0)
    _write(root, "generate/_COMPLETE", {"completed_at": NOW - 99_000, "shards_committed": 5})
    status = read_status(open_run(str(root)), now=NOW)
    assert (status["stalled"], status["generate"]["state"]) == (False, "complete")
    assert status["generate"]["completed_at"] == NOW - 99_000


def test_before_generate_and_uncommitted_discovery(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _write(
        root, "run.json", {"fingerprint": {"target": {"model_path": "m"}}, "fingerprint_hash": "h"}
    )
    (root / "prompts").mkdir()
    pq.write_table(pa.table({"prompt_id": ["a", "b", "c"]}), root / "prompts" / "manifest.parquet")
    status = read_status(open_run(str(root)), now=NOW)
    assert status["generate"]["state"] == "not started"
    assert status["generate"]["requests"] == {"done": 0, "total": 0, "dead": 0}
    assert status["discover"]["committed"] is False
    assert status["discover"]["manifest_rows"] == 3
    assert status["discover"]["holdout_rows"] is None
    # a marker but no progress.json: liveness cannot be judged, so it is neither running nor stalled
    _write(root, "generate/_SUCCESS/s1.json", _marker("s1", 3, 0, 30, 40, {}))
    status = read_status(open_run(str(root)), now=NOW)
    assert (status["generate"]["state"], status["stalled"]) == ("incomplete", False)
    assert status["generate"]["requests"] == {"done": 3, "total": 0, "dead": 0}


def test_missing_folder_and_missing_run_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert status_main([str(missing)]) == EXIT_MISSING
    assert capsys.readouterr().err == f"eaglescale status: run folder {missing} does not exist\n"
    assert not missing.exists()  # status never creates the folder it was asked about
    empty = tmp_path / "empty"
    empty.mkdir()
    assert status_main([str(empty), "--json"]) == EXIT_MISSING
    err = capsys.readouterr().err
    assert f"{empty} has no run.json" in err
    assert status_main([str(empty), "--storage-option", "novalue"]) == EXIT_MISSING
    assert "--storage-option 'novalue': expected key=value" in capsys.readouterr().err


def test_corrupt_progress_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_run(tmp_path / "run")
    (root / "generate/progress.json").write_text("{not json")
    assert status_main([str(root)]) == EXIT_MISSING
    assert f"{root}/generate/progress.json: not valid JSON" in capsys.readouterr().err


def test_render_is_compact_for_hundreds_of_shards(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run", heartbeat_age=1000.0)
    plan = json.loads((root / "prompts/shards.json").read_text())
    progress = json.loads((root / "generate/progress.json").read_text())
    for i in range(300):
        plan["shards"].append(
            {"shard_id": f"x{i:04d}", "first_prompt_id": "", "last_prompt_id": "", "n_prompts": 10}
        )
        progress["shards"][f"x{i:04d}"] = {"state": "running", "requests": 20, "done": i % 20}
    (root / "prompts/shards.json").write_text(json.dumps(plan))
    (root / "generate/progress.json").write_text(json.dumps(progress))
    status = read_status(open_run(str(root)), now=NOW)
    console = Console(width=140, record=True, color_system=None)
    console.print(render_status(status))
    text = console.export_text()
    assert "STALLED: no heartbeat for 16m 40s" in text
    # done: 47 as before + sum(i % 20) over the 300 extra shards = 2,897 of 305 x 20
    assert "2,897 / 6,100 (47.5%), 1 dead" in text
    assert "2 / 305 committed (2 committed · 1 failed · 1 pending · 301 running)" in text
    assert "+282 more" in text  # 302 active shards, 20 shown
    shard_rows = [line for line in text.splitlines() if "/ 20 " in line]
    assert len(shard_rows) == 20
    assert "failed" in shard_rows[0] and "EngineUnavailable: no server" in shard_rows[0]
    assert "http://10.0.0.1:30000" in text
    assert len(text.splitlines()) < 60


def test_later_stages_show_extraction_training_and_the_gate(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run")
    run = open_run(str(root))
    assert {k: read_status(run, now=NOW)[k] for k in ("extract", "train", "gate")} == dict.fromkeys(
        ("extract", "train", "gate")
    )
    _write(root, "extract/_SUCCESS/s00000-abcd.json", {"rows": 20, "attempt": "x1"})
    _write(root, "train/best.json", {"step": 200, "sim_accept_len": 1.75})
    _write(root, "train/result.json", {"steps": 300})
    summary = {"outcome": "promote", "speedup": 1.31, "ci": [1.12, 1.5], "accept_length": 2.4, "message": "m"}
    _write(root, "gate/_SUCCESS.json", {"identity": {}, "summary": summary})
    _write(root, "promoted.json", {"draft_id": "run-abc123"})
    status = read_status(run, now=NOW)
    assert status["extract"] == {"shards": 1, "of": 2, "sequences": 20, "complete": False, "leased": []}
    assert status["train"] == {"steps": 300, "best_step": 200, "best_sim_accept_len": 1.75, "exported": False}
    assert status["gate"]["outcome"] == "promote" and status["gate"]["promoted_draft"] == "run-abc123"
    console = Console(width=120, record=True)
    console.print(render_status(status))
    text = console.export_text()
    assert "extract      running: 1 / 2 shards, 20 sequences" in text
    assert "PROMOTE: speedup 1.31x [1.12, 1.50], accept length 2.40" in text
    assert "run-abc123" in text


def test_a_running_gate_shows_where_it_is(tmp_path: Path) -> None:
    root = make_run(tmp_path / "run")
    run = open_run(str(root))
    progress = {"state": "running", "phase": "benchmark", "launches": {"planned": 22, "done": 5, "failed": 1},
                "current": "launch 6/22 eagle3-s3-k1-n4 rep 0: measuring", "updated_at": NOW - 3, "finished": []}  # fmt: skip
    _write(root, "gate/progress.json", progress)
    status = read_status(run, now=NOW)
    assert status["gate"]["outcome"] is None and status["gate"]["progress"]["launches"]["done"] == 5
    console = Console(width=120, record=True)
    console.print(render_status(status))
    text = console.export_text()
    assert "RUNNING: benchmark, 5 / 22 launches done (1 failed)" in text
    assert "launch 6/22 eagle3-s3-k1-n4 rep 0: measuring" in text
    assert "PROMOTE" not in text and "promoted" not in text  # nothing decided yet
    # A gate that failed says so, and why.
    _write(root, "gate/progress.json", {**progress, "state": "failed", "current": None,
                                        "message": "ServerStartError: baseline did not serve in 900 s"})  # fmt: skip
    console = Console(width=120, record=True)
    console.print(render_status(read_status(run, now=NOW)))
    text = console.export_text()
    assert "FAILED: benchmark, 5 / 22 launches done (1 failed)" in text
    assert "ServerStartError: baseline did not serve in 900 s" in text


def test_a_finished_run_reads_as_finished(tmp_path: Path, tiny_target_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real run folder generated with the local engine, then resumed by a process that found
    every shard committed (a rerun of the DAG): status shows the run's own duration and
    throughput, not the idle process's 0 tok/s and stale ETA, and the local engine's rows."""
    from tasks.config import load_config
    from tasks.engines.local import LocalEngine
    from tasks.generate.stage import GenerateStage
    from tasks.runfolder import ShardStore
    from tests.run_support import discover_and_fingerprint, generate_all, write_params

    params = write_params(
        tmp_path, tiny_target_dir, str(tmp_path / "run"),
        sampling={"max_new_tokens": 8}, discover={"total_prompts": 40}, generate={"shard_size": 20},
    )  # fmt: skip
    cfg = load_config(params)
    generate_all(cfg)
    root = tmp_path / "run"
    first = json.loads((root / "generate/progress.json").read_text())
    markers = ShardStore(open_run(str(root)), "generate").committed()
    rows = sum(m["rows"] for m in markers.values())
    tokens = sum(m["completion_tokens"] for m in markers.values())
    finished = max(m["committed_at"] for m in markers.values())

    time.sleep(1.0)  # the resume starts visibly later than the run did
    run, tokenizer, fp_hash = discover_and_fingerprint(cfg)
    engine = LocalEngine(cfg.target.model_path)
    idle = GenerateStage(cfg, run, fp_hash, engine, tokenizer)
    assert idle.prepare() == []
    idle.finish()
    engine.close()
    last = json.loads((root / "generate/progress.json").read_text())
    assert last["rate"]["lifetime_tokens_per_s"] == 0.0  # what status used to show
    assert last["first_started_at"] == first["started_at"] < last["started_at"]

    assert status_main([str(root), "--json"]) == EXIT_OK
    gen = json.loads(capsys.readouterr().out)["generate"]
    overall = gen["overall"]
    assert gen["state"] == "complete"
    assert (overall["started_at"], overall["finished_at"]) == (first["started_at"], finished)
    duration = finished - first["started_at"]
    assert overall["duration_s"] == pytest.approx(duration)
    assert overall["completion_tokens"] == tokens > 0
    assert overall["tokens_per_s"] == pytest.approx(tokens / duration)
    assert overall["requests_per_s"] == pytest.approx(rows / duration)
    assert gen["committed"]["per_server"] == {"local": rows}
    assert (gen["committed"]["requests_sent"], gen["committed"]["sent_per_request"]) == (rows, 1.0)

    console = Console(width=160, record=True, color_system=None)
    console.print(render_status(read_status(open_run(str(root)))))
    text = console.export_text()
    took = format_duration(duration)
    assert f"{tokens:,} tokens in {took}: {tokens / duration:,.1f} tok/s" in text
    assert "since start" not in text and "ETA" not in text
    assert f"{rows:,} requests to the engine, 1.000 per request" in text
    local_row = next(line for line in text.splitlines() if "│ local " in line)
    assert f" {rows:,} " in local_row


def test_stage_clocks_show_when_each_stage_ran(tmp_path: Path) -> None:
    """The stage flows' clocks (flows/common.stage_run, run outside Prefect here) as status reads
    them: a completed stage with its duration, a failed one with its error, one still running."""
    from flows.common import stage_run
    from tasks.config import load_config

    root = make_run(tmp_path / "run")
    stray = root / "prompts/.tmp-0a1b2c-manifest.parquet"  # a write killed mid-way, long ago
    stray.write_bytes(b"PAR1")
    os.utime(stray, (NOW, NOW))
    cfg = load_config(ROOT / "deployments/params/smoke.yaml", run_root=str(root))
    with stage_run(cfg, "discover"):
        pass
    assert not stray.exists()
    # The stage's log lines, in the run folder's log file of this process.
    (log_file,) = (root / "logs").iterdir()
    assert "discover: removed 1 temp files left by interrupted writes" in log_file.read_text()
    with pytest.raises(RuntimeError), stage_run(cfg, "generate"):
        raise RuntimeError("no server at http://user:pw@127.0.0.1:9")
    run = open_run(str(root))
    clocks = read_status(run)["stages"]
    assert list(clocks) == ["discover", "generate"]
    assert clocks["discover"]["state"] == "completed" and clocks["discover"]["ended_at"] >= clocks["discover"]["started_at"]
    gen = clocks["generate"]
    assert gen["state"] == "failed" and gen["attempts"] == 1
    assert gen["error"] == "RuntimeError: no server at http://***@127.0.0.1:9"  # credentials redacted
    with stage_run(cfg, "generate"):  # the retry: running while inside, its first start kept
        running = read_status(run)["stages"]["generate"]
        assert running["state"] == "running" and running["ended_at"] is None and running["attempts"] == 2
        assert running["first_started_at"] == gen["started_at"] <= running["started_at"]
        console = Console(width=160, record=True, color_system=None)
        console.print(render_status(read_status(run)))
        assert "stages       discover 0s · generate running" in console.export_text()
    assert read_status(run)["stages"]["generate"]["state"] == "completed"


def test_a_stopped_run_reads_as_stopped_with_whole_urls_at_80_columns(tmp_path: Path) -> None:
    """The generating process was killed 10 minutes ago: its stage clock still says running,
    but its heartbeat is old, so the stage and the run read as stopped (exit 3), not running.
    Server URLs are copied from this view: at 80 columns each is still whole."""
    root = make_run(tmp_path / "run", heartbeat_age=600.0)
    progress = json.loads((root / "generate/progress.json").read_text())
    urls = ["http://sglang-gen-node-017.cluster.internal:30000", "https://10.200.31.7:30000/v1/sglang-generation-pool-a"]
    progress["servers"] = [{**progress["servers"][0], "url": u, "last_error": "ReadTimeout " * 8} for u in urls]
    _write(root, "generate/progress.json", progress)
    _write(root, "stages/generate.json", {"stage": "generate", "state": "running", "started_at": NOW - 2000,
                                          "ended_at": None, "first_started_at": NOW - 2000, "attempts": 1,
                                          "heartbeat_at": NOW - 600, "heartbeat_s": 30.0})  # fmt: skip
    status = read_status(open_run(str(root)), now=NOW)
    assert status["stages"]["generate"]["state"] == "stopped"
    assert status["generate"]["state"] == "stopped" and status["stalled"]
    console = Console(width=80, record=True, color_system=None)
    console.print(render_status(status))
    text = console.export_text()
    assert all(u in text for u in urls), text
    assert "STOPPED" in text and "generate STOPPED after 23m" in text.replace("\n", " ")


def test_follow_shows_the_running_stage_until_the_gate_decides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eaglescale status --follow` (not a terminal here: a line per change): the running stage's
    figures, generation's live ones, until the decision (exit 0); a failed stage ends it (1)."""
    import threading

    root = make_run(tmp_path / "run")
    now = time.time()
    clock = {"state": "running", "started_at": now - 60, "ended_at": None, "heartbeat_at": now, "heartbeat_s": 30}
    _write(root, "stages/generate.json", {"stage": "generate", **clock})

    def decide() -> None:
        time.sleep(0.5)
        _write(root, "stages/generate.json", {"stage": "generate", **clock, "state": "completed", "ended_at": now})
        summary = {"outcome": "reject", "speedup": 0.8389377069980071, "ci": [0.6851852549722078, 1.3755248221309815]}
        _write(root, "gate/_SUCCESS.json", {"identity": {}, "summary": summary})
        _write(root, "stages/gate.json", {"stage": "gate", **clock, "state": "completed", "ended_at": time.time()})

    writer = threading.Thread(target=decide)
    writer.start()
    assert status_main([str(root), "--follow", "0.1"]) == EXIT_OK
    writer.join()
    lines = capsys.readouterr().out.splitlines()
    assert "generate running · generate: 47 / 100 (47%), 2.5 tok/s, 0.02 req/s (last 5m 00s), ETA 19m 20s" in lines[0]
    assert lines[-1].endswith("generate completed · gate completed · gate: REJECT: speedup 0.839x [0.685, 1.38]"), lines
    assert len(lines) == 2  # a line per change, not per look
    _write(root, "stages/train.json", {"stage": "train", **clock, "state": "failed", "ended_at": now, "error": "TrainError: x"})
    assert status_main([str(root), "--follow", "0.1"]) == 1
    assert "train failed" in capsys.readouterr().out
