"""kill -9 the extract stage (plain code in a subprocess) at exact points of the commit
protocol (between data parts included) and at seeded random moments, then let it finish:
every committed generation row ends up extracted exactly once (dead only where the data says
so: no fault but the kills is injected), and no part or other object that no marker names is
left behind.

More kills than the generation crash test (tests/test_crash_resume.py), counted apart:
failpoint kills, each checked on disk to sit inside a commit, and random kills budgeted by
the parts the killed runner wrote, never by time."""

from __future__ import annotations

import random
import signal
import subprocess
import sys

from tasks.runfolder import RunFolder, ShardStore
from tests.extract_support import SHARD_SIZE, TOTAL_PROMPTS, extracted_ids, generated_run
from tests.run_support import (
    ROOT,
    cli_env,
    kill_at_progress,
    left_mid_commit,
    marked_unreleased,
    rows_by_request,
    unmarked_objects,
)

# One part per sequence (8 per shard): kills between parts are many and cheap.
PART_BYTES = 1
SHARDS = TOTAL_PROMPTS // SHARD_SIZE  # 6
# Seven exact points; four of them commit a shard (after_data:2 and after_part:12 one before
# they fire, each after_marker:1 its own): 4 of the 6 shards, the rest stay inside a shard.
FAILPOINTS = [
    "commit.after_part:1", "commit.after_data:2", "commit.after_part:5", "commit.before_marker:1",
    "commit.after_marker:1", "commit.after_part:12", "commit.after_marker:1",
]  # fmt: skip
# A random kill waits for 1..3 parts of its runner's own attempt, then a pause of up to
# PAUSE_S cut short at 2 more parts (polled every few ms): at most ~6 of a shard's 8 parts,
# so random kills never use up the shards left (a killed attempt's parts are discarded)
# however fast the machine.
RANDOM_KILLS = 18
PAUSE_S = 0.15
# A killed runner's shard lease keeps the next runner off that shard until it expires
# (a runner's own start-up, ~2 s, outlasts it).
LEASES = {"lease_ttl_s": 2.0, "lease_heartbeat_s": 0.5}


def _start(params, tmp_path, log, failpoint: str | None = None) -> subprocess.Popen:
    env = cli_env(tmp_path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("EAGLESCALE_FAILPOINT", None)
    if failpoint:
        env["EAGLESCALE_FAILPOINT"] = failpoint
    # Its own process group: a failpoint SIGKILLs the whole group, never pytest.
    return subprocess.Popen(
        [sys.executable, "-m", "tests.extract_support", str(params), str(PART_BYTES)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )


def test_kill9_mid_extraction_then_resume_extracts_every_row_once(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, params = generated_run(
        tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path, batch_size=1, **LEASES
    )
    run = RunFolder(cfg.run_root)
    log = open(tmp_path / "runner.log", "a")  # noqa: SIM115 - shared with the children

    failpoint_kills = 0
    for point in FAILPOINTS:
        proc = _start(params, tmp_path, log, point)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, f"failpoint {point} did not fire: {out}"
        # Killed inside a commit: parts (and dead letters) of its attempt with no marker, or
        # a marker whose lease it never released.
        stray = left_mid_commit(run, "extract", proc.pid)
        parts = {rel for rel in stray if rel.startswith("extract/data/")}
        if point.startswith("commit.after_marker"):
            assert not stray and marked_unreleased(run, "extract", proc.pid), point
        elif point.startswith("commit.before_marker"):
            assert len(parts) == SHARD_SIZE and len(stray) == SHARD_SIZE + 1, stray
        else:
            nth = int(point.split(":")[1])
            assert len(parts) == (1 if point.startswith("commit.after_data") else (nth - 1) % SHARD_SIZE + 1), stray
            assert stray == parts, stray
        failpoint_kills += 1
    committed_before = len(ShardStore(run, "extract").committed())
    assert committed_before == 4

    def parts_of(pid: int) -> int:
        return sum(f"-{pid}-" in name for name in run.listdir("extract/data"))

    rng = random.Random(20261129)
    random_kills = 0
    for _ in range(RANDOM_KILLS):
        proc = _start(params, tmp_path, log)
        line = proc.stdout.readline()
        assert line == f"READY {SHARDS - committed_before}\n", line
        first_at = rng.randint(1, 3)
        kill_at_progress(proc, lambda pid=proc.pid: parts_of(pid), first_at, rng.uniform(0.0, PAUSE_S), first_at + 2, poll_s=0.005)
        random_kills += 1
    # The random kills took no shard: the final run below still had all the work left.
    assert len(ShardStore(run, "extract").committed()) == committed_before

    final = _start(params, tmp_path, log)
    out, _ = final.communicate(timeout=300)
    log.close()
    assert final.returncode == 0, (tmp_path / "runner.log").read_text()[-3000:]
    assert out.strip().endswith("COMPLETE")
    assert (failpoint_kills, random_kills) == (len(FAILPOINTS), RANDOM_KILLS)

    rows, dead = extracted_ids(run)
    generated = rows_by_request(run, "generate")
    # The only dead letters are the rows whose prompt leaves no room for a response within
    # max_length (prompt_too_long): what the data decides, never a kill.
    too_long = {rid for rid, row in generated.items() if row["prompt_tokens"] >= cfg.extract.max_length}
    assert too_long and sorted(dead) == sorted(too_long)
    assert len(rows) == len(set(rows)) and sorted(rows) == sorted(generated.keys() - too_long)
    assert unmarked_objects(run, "extract") == set()
    markers = ShardStore(run, "extract").committed().values()
    assert all(len(m["parts"]) == m["rows"] for m in markers)  # one part per sequence
    assert ShardStore(run, "extract").is_complete()
