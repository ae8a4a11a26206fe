"""kill -9 a generating run through the real CLI, again and again, then finish it.

The kills land at seeded random moments of generation (after each run's first journaled
result, so they fall inside shards rather than during start-up) and at exact points of
the commit protocol (failpoints). The finished run must hold every planned request exactly
once, minus dead letters.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from pathlib import Path

import pytest

from tasks.runfolder import RunFolder, ShardStore
from tests.prefect_support import prefect_server
from tests.run_support import assert_exactly_once, cli_env, start_cli, write_params

KILLS_AT_RANDOM = 20
COMMIT_FAILPOINTS = ["commit.after_data:2", "commit.before_marker:1", "commit.after_marker:3"]


def journal_lines(run_dir: Path) -> int:
    total = 0
    for path in (run_dir / "generate" / "journal").rglob("*.jsonl"):
        with open(path, "rb") as f:
            total += f.read().count(b"\n")
    return total


def kill_group(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture
def api_env(tmp_path):
    """One real Prefect server for the many CLI runs (an ephemeral API per run costs ~7 s)."""
    with prefect_server(tmp_path / "prefect-server-home") as url:
        yield lambda **extra: cli_env(tmp_path, PREFECT_API_URL=url, **extra)


@pytest.mark.slow
def test_kill9_at_random_moments_then_resume_is_exactly_once(tmp_path, tiny_target_dir, api_env):
    run_dir = tmp_path / "run"
    params = write_params(
        tmp_path,
        tiny_target_dir,
        str(run_dir),
        sampling={"max_new_tokens": 48, "samples_per_prompt": 3},
        engine={"kind": "local", "batch_size": 4},
        # Each kill leaves its shards leased; a short TTL lets the next run take them over
        # (its own start-up outlasts it) instead of waiting the default two minutes.
        generate={
            "shard_size": 12,
            "max_parallel_shards": 2,
            "journal_flush_s": 0.2,
            "lease_ttl_s": 2.0,
            "lease_heartbeat_s": 0.5,
        },
        discover={"total_prompts": 128},
        stages=["discover", "generate"],  # extraction has its own kill -9 test
    )
    args = ["run", "--params", str(params)]
    log = tmp_path / "cli.log"
    rng = random.Random(20261129)
    kills = 0

    # Discovery first, so every kill below lands in generation.
    first = start_cli([*args, "--stages", "discover"], api_env(), log)
    assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    total_requests = 128 * 3

    for point in COMMIT_FAILPOINTS:
        proc = start_cli(args, api_env(EAGLESCALE_FAILPOINT=point), log)
        rc = proc.wait(timeout=300)
        assert rc == -signal.SIGKILL, f"failpoint {point} did not fire (rc={rc})"
        kill_group(proc)
        kills += 1

    for _ in range(KILLS_AT_RANDOM):
        done = journal_lines(run_dir)
        if done >= total_requests:
            break
        proc = start_cli(args, api_env(), log)
        deadline = time.time() + 300
        # Wait for this run's first result, then kill at a random moment after it: inside a
        # batch, between journal lines, or in the middle of a commit.
        while proc.poll() is None and journal_lines(run_dir) <= done and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))
        if proc.poll() is None:
            kill_group(proc)
            kills += 1

    final = start_cli(args, api_env(), log)
    assert final.wait(timeout=600) == 0, log.read_text()[-4000:]

    assert kills >= 20
    run = RunFolder(str(run_dir))
    rows, dead = assert_exactly_once(run)
    assert rows + dead == total_requests
    store = ShardStore(run, "generate")
    assert store.is_complete()
    # The resumes were real: some shard's journal holds more than one attempt.
    attempts = [len(list((run_dir / "generate/journal" / s).iterdir())) for s in store.committed()]
    assert max(attempts) >= 2
    # Nothing unmarked is left behind, and every marker names a file that exists.
    named = {Path(m["data"]).name for m in store.committed().values()}
    assert set(os.listdir(run_dir / "generate/data")) == named
