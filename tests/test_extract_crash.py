"""kill -9 the extract stage (plain code in runners forked by a fork server: a kill costs a
fork, not an interpreter start) at exact points of the commit protocol (between data parts
included) and at seeded random moments, then let it finish:
every committed generation row ends up extracted exactly once (dead only where the data says
so: no fault but the kills is injected), and no part or other object that no marker names is
left behind.

More kills than the generation crash test (tests/test_crash_resume.py), counted apart:
failpoint kills, each checked on disk to sit inside a commit, and random kills budgeted by
the parts the killed runner wrote, never by time."""

from __future__ import annotations

import os
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
# PAUSE_S cut short at 2 more parts. A part takes a few ms here, faster than any poll, so the
# runner also carries the failpoint commit.after_part at that cap: it never writes more than
# 5 of a shard's 7-8 parts, and random kills never use up the shards left (a killed attempt's
# parts are discarded) however fast the machine. Kills by the timer and by the cap are
# counted apart.
RANDOM_KILLS = 22
PAUSE_S = 0.15
# A killed runner's shard lease keeps the next runner off that shard until it expires; runners
# fork in milliseconds (below), so a short TTL keeps that wait short. One runner lives at a
# time: no live holder can lose its lease to a stall.
LEASES = {"lease_ttl_s": 1.0, "lease_heartbeat_s": 0.25}


class Runner:
    """One runner forked by the fork server of tests.extract_support, in its own session: a
    kill of its group (a failpoint's, or ours) spares the server. Duck-types what the tests
    use of subprocess.Popen: pid, poll(), wait(), returncode."""

    def __init__(self, server: subprocess.Popen, failpoint: str | None) -> None:
        self.server = server
        server.stdin.write(f"{failpoint or '-'}\n")
        server.stdin.flush()
        line = server.stdout.readline()
        assert line.startswith("PID "), line
        self.pid = int(line.split()[1])
        self.returncode: int | None = None
        self.lines: list[str] = []

    def readline(self) -> str:
        line = self.server.stdout.readline()
        assert line, "the fork server ended"
        if line.startswith(f"EXIT {self.pid} "):
            self.returncode = int(line.split()[2])
            return ""
        self.lines.append(line)
        return line

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)  # the server reaps it at once: gone means ended
            except ProcessLookupError:
                while self.returncode is None:
                    self.readline()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        while self.returncode is None:
            self.readline()
        return self.returncode


def _fork_server(params, tmp_path, log) -> subprocess.Popen:
    env = cli_env(tmp_path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("EAGLESCALE_FAILPOINT", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.extract_support", "--fork", str(params), str(PART_BYTES)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    assert server.stdout.readline() == "SERVING\n"
    return server


def test_kill9_mid_extraction_then_resume_extracts_every_row_once(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, params = generated_run(
        tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path, batch_size=1, **LEASES
    )
    run = RunFolder(cfg.run_root)
    log = open(tmp_path / "runner.log", "a")  # noqa: SIM115 - shared with the children
    server = _fork_server(params, tmp_path, log)
    try:
        _kill_and_resume(cfg, run, server, tmp_path)
    finally:
        server.kill()
        server.wait(timeout=60)
        log.close()


def _kill_and_resume(cfg, run, server, tmp_path):
    gen = ShardStore(run, "generate")

    def fitting(shard: str) -> int:
        """Sequences (one part each) of a shard: its rows whose prompt fits max_length."""
        tokens = gen.read_rows(gen.committed()[shard]).column("prompt_tokens").to_pylist()
        return sum(t < cfg.extract.max_length for t in tokens)

    failpoint_kills = 0
    for point in FAILPOINTS:
        proc = Runner(server, point)
        assert proc.wait() == -signal.SIGKILL, f"failpoint {point} did not fire: {proc.lines}"
        # Killed inside a commit: parts (and dead letters) of its attempt with no marker, or
        # a marker whose lease it never released.
        stray = left_mid_commit(run, "extract", proc.pid)
        parts = {rel for rel in stray if rel.startswith("extract/data/")}
        if point.startswith("commit.after_marker"):
            assert not stray and marked_unreleased(run, "extract", proc.pid), point
        elif point.startswith("commit.before_marker"):  # every part of one shard, and its dead letters
            (shard,) = {rel.rsplit("/", 1)[1].split(".")[0] for rel in parts}
            assert len(parts) == fitting(shard) and len(stray) == len(parts) + 1, stray
        elif point.startswith("commit.after_data"):  # the first part of a shard
            assert len(parts) == 1 and stray == parts, stray
        else:  # the nth part this runner wrote, counting those of the shards it committed
            mine = [m for m in ShardStore(run, "extract").committed().values() if f"-{proc.pid}-" in m["attempt"]]
            nth = int(point.split(":")[1])
            assert len(parts) == nth - sum(len(m["parts"]) for m in mine) and stray == parts, stray
        failpoint_kills += 1
    committed_before = len(ShardStore(run, "extract").committed())
    assert committed_before == 4

    def parts_of(pid: int) -> int:
        return sum(f"-{pid}-" in name for name in run.listdir("extract/data"))

    rng = random.Random(20261129)
    random_kills, capped = 0, 0
    for _ in range(RANDOM_KILLS):
        first_at = rng.randint(1, 3)
        proc = Runner(server, f"commit.after_part:{first_at + 2}")
        line = proc.readline()
        assert line == f"READY {SHARDS - committed_before}\n", line
        pause = rng.uniform(0.0, PAUSE_S)
        if kill_at_progress(proc, lambda pid=proc.pid: parts_of(pid), first_at, pause, first_at + 2, poll_s=0.005):
            random_kills += 1
        else:
            capped += 1
        assert proc.returncode == -signal.SIGKILL, proc.lines
    print(f"{failpoint_kills} failpoint kills, {random_kills} timed random kills, {capped} at their cap")
    # The random kills took no shard: the final run below still had all the work left.
    assert len(ShardStore(run, "extract").committed()) == committed_before

    final = Runner(server, None)
    assert final.wait() == 0, (tmp_path / "runner.log").read_text()[-3000:]
    assert final.lines[-1] == "COMPLETE\n"
    assert (failpoint_kills, random_kills + capped) == (len(FAILPOINTS), RANDOM_KILLS)

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
