"""Stopping `eaglescale run`: SIGTERM stops it within seconds, cleanly; kill -9 takes its
temporary Prefect API with it; the resume sends only what was missing.

One run root, two runs of the real CLI on eaglescale's own temporary Prefect API (no
PREFECT_API_URL), against a simulated SGLang server slow enough to be stopped mid-generation.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx

from tasks.runfolder import RunFolder, read_journal
from tasks.standins.server import ServerProcess
from tests.run_support import (
    cli_env,
    kill_group,
    start_cli,
    write_params,
)

# SIGTERM to a run in the middle of generation: shards stop where they are (their requests are
# dropped, not awaited), leases are released, Prefect hears of it and the temporary API stops.
# On an idle 2-core box that takes ~2 s; the bound leaves room for a loaded one.
STOP_BOUND_S = 20.0
# kill -9 of eaglescale: its temporary API notices the closed pipe and exits (~1 s measured).
ORPHAN_BOUND_S = 15.0
PROMPTS = 96


def _journaled_ok(run: RunFolder) -> set[str]:
    return {
        r["request_id"]
        for shard in run.listdir("generate/journal")
        for r in read_journal(run, "generate", shard).records
        if r["status"] == "ok"
    }


def _until(predicate, what: str, proc, log: Path, limit_s: float = 240.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def _api_port(log: Path) -> int:
    found = re.findall(r"temporary Prefect API at http://127\.0\.0\.1:(\d+)/api", log.read_text())
    assert found, log.read_text()[-3000:]
    return int(found[-1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _session(sid: int) -> list[str]:
    """The processes of session `sid` (start_cli starts each run in its own), as 'pid cmd'."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    out.append(f"{entry} {Path(f'/proc/{entry}/cmdline').read_bytes()[:200]!r}")
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                pass
    return out


def _sent(url: str) -> int:
    return httpx.get(f"{url}/_stats").json()["generate_requests"]


def test_sigterm_stops_within_seconds_and_kill9_takes_the_temporary_api_along(
    tmp_path, tiny_target_dir
):
    run_dir = tmp_path / "run"
    run = RunFolder(str(run_dir))
    log = tmp_path / "cli.log"
    # A request takes its prompt length plus 16 steps of 10 ms, 8 at a time: ~10 s in all, long
    # enough to be stopped in the middle.
    server = ServerProcess(["--simulate", "--step-latency-ms", "10", "--vocab-size", "2048", "--max-batch", "8"])
    try:
        params = write_params(
            tmp_path, tiny_target_dir, str(run_dir),
            stages=["discover", "generate"],
            sampling={"max_new_tokens": 16},
            discover={"total_prompts": PROMPTS},
            engine={"kind": "sglang", "endpoints": [server.url], "concurrency_per_server": 4},
            generate={"shard_size": 12, "max_parallel_shards": 2, "progress_interval_s": 1},
        )  # fmt: skip
        args = ["run", "--params", str(params)]
        env = cli_env(tmp_path, OMP_NUM_THREADS="1")  # no PREFECT_API_URL: the temporary API

        # 1. SIGTERM to eaglescale alone (as `kill PID` sends it), mid-generation.
        proc = start_cli(args, env, log)
        try:
            _until(lambda: len(_journaled_ok(run)) >= 8, "some results journaled", proc, log)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
            took = time.monotonic() - t0
        finally:
            kill_group(proc)
        out = log.read_text()
        assert rc == 143, out[-3000:]
        assert took < STOP_BOUND_S, f"stopped in {took:.1f} s"
        assert "Traceback" not in out, out[-3000:]
        port = _api_port(log)
        last = out.strip().splitlines()[-1]
        assert last == f"eaglescale: stopped by SIGTERM; resume with: eaglescale run --params {params} --run-root {run_dir}"
        assert _session(proc.pid) == [] and _port_free(port)  # no child left, the API's port free
        leases = [json.loads(p.read_text()) for p in (run_dir / "generate/leases").glob("*.json")]
        assert leases and all(r["released"] for r in leases)  # every lease handed back
        progress = run.read_json("generate/progress.json")
        assert progress["state"] == "stopped"
        journaled = _journaled_ok(run)
        assert 8 <= len(journaled) < PROMPTS

        # 2. Resume, then kill -9 eaglescale alone: its temporary API exits without it.
        before = _sent(server.url)
        proc = start_cli(args, env, log)
        try:
            _until(lambda: len(_journaled_ok(run)) >= len(journaled) + 8, "more results", proc, log)
            port = _api_port(log)
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            proc.wait(timeout=60)
            deadline = killed + ORPHAN_BOUND_S
            while not (_port_free(port) and _session(proc.pid) == []) and time.monotonic() < deadline:
                time.sleep(0.1)
            orphaned_for = time.monotonic() - killed
        finally:
            kill_group(proc)
        assert _port_free(port) and _session(proc.pid) == [], f"left running {orphaned_for:.1f} s after kill -9"
        print(f"SIGTERM stop: {took:.1f} s; temporary API gone {orphaned_for:.1f} s after kill -9")
        # The resume sent only what no journal held: what the stop had journaled was not sent
        # again (no request journaled twice), and it sent no more than was missing.
        records = [r["request_id"] for shard in run.listdir("generate/journal")
                   for r in read_journal(run, "generate", shard).records if r["status"] == "ok"]  # fmt: skip
        assert len(records) == len(set(records)) > len(journaled)
        assert _sent(server.url) - before <= PROMPTS - len(journaled)
    finally:
        server.stop()
