"""A whole smoke run on an s3:// run root (moto's S3 server), and two CLI workers racing
one local run root: both end with every planned request committed exactly once, and shard
leases keep them from duplicating work."""

from __future__ import annotations

import pytest

from tasks.runfolder import RunFolder, ShardStore
from tests.prefect_support import prefect_server
from tests.run_support import assert_exactly_once, cli_env, start_cli, write_params
from tests.s3_support import moto_s3


def test_smoke_run_on_s3_run_root(tmp_path, tiny_target_dir, monkeypatch):
    with moto_s3(monkeypatch) as s3:
        url = f"s3://{s3['bucket']}/runs/smoke"
        params = write_params(
            tmp_path,
            tiny_target_dir,
            url,
            sampling={"max_new_tokens": 8},
            discover={"total_prompts": 60},
            generate={"shard_size": 25},
            storage_options=s3["storage_options"],
        )
        log = tmp_path / "cli.log"
        env = cli_env(tmp_path)  # carries the AWS_* test credentials set by moto_s3
        assert start_cli(["run", "--params", str(params)], env, log).wait(timeout=600) == 0, (
            log.read_text()[-3000:]
        )
        run = RunFolder(url, s3["storage_options"])
        rows, dead = assert_exactly_once(run)
        assert (rows, dead) == (60, 0)
        store = ShardStore(run, "generate")
        assert store.is_complete() and len(store.committed()) == 3
        # Object stores get journal chunks (no append), read back in order.
        shard = sorted(store.committed())[0]
        attempts = run.listdir(f"generate/journal/{shard}")
        assert attempts and run.listdir(f"generate/journal/{shard}/{attempts[0]}")
        progress = run.read_json("generate/progress.json")
        assert progress["requests"]["done"] == 60
        # The later stages on the object store: extraction, the exported draft, the gate.
        assert ShardStore(run, "extract").is_complete()
        assert run.exists("train/final/model.safetensors")
        decision = run.read_json("gate/_SUCCESS.json")["summary"]
        assert decision["outcome"] in ("promote", "reject", "stopped") and decision["message"]
        assert run.exists("gate/report.md")
        assert run.read_json("gate/replay.json")["overall"]
        assert "testing" not in log.read_text()  # the secret key never reaches the logs


@pytest.mark.slow
def test_two_workers_on_one_run_root_commit_exactly_once(tmp_path, tiny_target_dir):
    run_dir = tmp_path / "run"
    params = write_params(
        tmp_path,
        tiny_target_dir,
        str(run_dir),
        sampling={"max_new_tokens": 48, "samples_per_prompt": 4},
        engine={"kind": "local", "batch_size": 2},
        discover={"total_prompts": 90},
        generate={"shard_size": 15, "max_parallel_shards": 2},
        stages=["discover", "generate"],  # the race under test is generation's
    )
    with prefect_server(tmp_path / "prefect-home") as api:
        env = cli_env(tmp_path, PREFECT_API_URL=api)
        log = tmp_path / "cli.log"
        assert start_cli(["run", "--params", str(params), "--stages", "discover"], env, log).wait(300) == 0
        # Both workers start together, each leaving the shards the other has leased. (The second
        # once joined when the first was inside its first shards; on a loaded 2-core box its
        # start-up outlasted the first's whole generation, and it found the work done.)
        workers = [start_cli(["run", "--params", str(params)], env, tmp_path / f"w{i}.log") for i in range(2)]
        codes = [w.wait(timeout=600) for w in workers]
    logs = [(tmp_path / f"w{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n".join(x[-2000:] for x in logs)
    run = RunFolder(str(run_dir))
    rows, dead = assert_exactly_once(run)
    assert (rows, dead) == (360, 0)
    markers = ShardStore(run, "generate").committed()
    assert len(markers) == 6
    # Both workers did commit shards (an attempt id carries its writer's pid): the second
    # one did not just find the work done.
    committers = {w.pid for w in workers for m in markers.values() if f"-{w.pid}-" in m["attempt"]}
    assert committers == {w.pid for w in workers}, [m["attempt"] for m in markers.values()]
    assert len(run.listdir("generate/data")) == 6  # the losing writer's files are gone
    # Shard leases kept the live workers off each other's shards: one attempt per shard.
    attempts = {s: len(run.listdir(f"generate/journal/{s}")) for s in markers}
    assert set(attempts.values()) == {1}, attempts
