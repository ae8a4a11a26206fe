"""kill -9 the extract stage (plain code in a subprocess) at exact points of the commit
protocol (between data parts included) and at seeded random moments, then let it finish:
every committed generation row ends up extracted (or dead-lettered) exactly once, and no
part or other object that no marker names is left behind."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time

from tasks.runfolder import RunFolder, ShardStore
from tests.extract_support import extracted_ids, generated_run, unmarked_objects
from tests.run_support import ROOT

# after_data: after a shard's first part; after_part:5: between two parts of a shard.
FAILPOINTS = ["commit.after_data:2", "commit.after_part:5", "commit.before_marker:3"]
RANDOM_KILLS = 2
# The tiny target's shards (8 rows, ~30-130 kB each) become 4 to 8 parts.
PART_BYTES = 60_000
# A killed runner's shard lease keeps the next runner off that shard until it expires.
LEASES = {"lease_ttl_s": 2.0, "lease_heartbeat_s": 0.5}


def _start(params, log, failpoint: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
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


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def test_kill9_mid_extraction_then_resume_extracts_every_row_once(
    tmp_path_factory, tmp_path, tiny_target_dir
):
    cfg, params = generated_run(
        tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path, batch_size=1, **LEASES
    )
    run = RunFolder(cfg.run_root)
    log = open(tmp_path / "runner.log", "a")  # noqa: SIM115 - shared with the children

    for point in FAILPOINTS:
        proc = _start(params, log, point)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, f"failpoint {point} did not fire: {out}"
        # Killed inside a shard attempt: the parts it wrote have no marker.
        stray = unmarked_objects(run)
        assert any(".p0000.safetensors" in rel for rel in stray), (point, stray)
        if point.startswith("commit.after_part"):
            assert len({rel for rel in stray if rel.startswith("extract/data/")}) >= 2, stray
    committed_before = len(ShardStore(run, "extract").committed())
    assert committed_before >= 1

    rng = random.Random(20261129)
    for _ in range(RANDOM_KILLS):
        proc = _start(params, log)
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        # Past the model load, into the shards: after one more commit when two or more are
        # left, then a seeded random pause.
        if int(line.split()[1]) >= 2:
            assert proc.stdout.readline().startswith("COMMITTED")
        time.sleep(rng.uniform(0.0, 0.5))
        _kill_group(proc)

    final = _start(params, log)
    out, _ = final.communicate(timeout=300)
    log.close()
    assert final.returncode == 0, (tmp_path / "runner.log").read_text()[-3000:]
    assert out.strip().endswith("COMPLETE")

    rows, dead = extracted_ids(run)
    gen = ShardStore(run, "generate")
    planned = [
        r
        for m in gen.committed().values()
        for r in gen.read_rows(m).column("request_id").to_pylist()
    ]
    assert len(rows) == len(set(rows)) and not set(rows) & set(dead)
    assert sorted(rows + dead) == sorted(planned)
    assert unmarked_objects(run) == set()
    markers = ShardStore(run, "extract").committed().values()
    assert all(len(m["parts"]) >= 3 for m in markers)
    assert ShardStore(run, "extract").is_complete()
