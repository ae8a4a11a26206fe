"""`orchestration.overlap: true` through the real CLI: extraction runs alongside generation.

The overlapped run commits the same extraction as a sequential one, shard by shard (same
generation source, same sequence ids, same bytes); its stage clocks overlap; a kill -9 while
both stages are active, then a resume, still gives exactly that; and a generation that fails
stops extraction and fails the run with generation's error.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tasks.runfolder import RunFolder, ShardStore
from tasks.runfolder.parts import marker_parts
from tasks.standins.server import ServerProcess
from tasks.status.read import read_status
from tests.extract_support import extracted_ids
from tests.prefect_support import prefect_server
from tests.run_support import (
    assert_exactly_once,
    cli_env,
    kill_group,
    start_cli,
    unmarked_objects,
    write_params,
)

PROMPTS, SHARD_SIZE = 60, 5  # 12 generation shards, one at a time: many markers to follow
# A killed run's leases keep the resume off its shards until they expire.
LEASES = {"lease_ttl_s": 2.0, "lease_heartbeat_s": 0.5}


def _params(tmp_path: Path, model_dir: Path, name: str, overlap: bool, server_url: str = "http://127.0.0.1:9",
            **sections: Any) -> Path:  # fmt: skip
    """Generation goes to `server_url` (the module's SGLang-compatible server: a test can hold
    its answers with an injected fault, so a stage's timing is the test's, not the machine's),
    one request at a time, with a timeout longer than any hold."""
    folder = tmp_path / name
    folder.mkdir()
    sections = {
        "stages": ["discover", "generate", "extract"],
        "sampling": {"max_new_tokens": 24},
        "discover": {"total_prompts": PROMPTS},
        "engine": {"kind": "sglang", "endpoints": [server_url], "concurrency_per_server": 1, "request_timeout_s": 600},
        "generate": {"shard_size": SHARD_SIZE, "max_parallel_shards": 1, **LEASES},
        "extract": {"batch_size": 4, "max_length": 256, **LEASES},
        "orchestration": {"overlap": overlap},
        **sections,
    }
    return write_params(folder, model_dir, str(folder / "run"), **sections)


def _extraction(run: RunFolder) -> dict[str, tuple[list[str], int, int]]:
    """Per extract shard: its parts' sha256s (sequence ids and states), rows, dead. (Not the
    generation source's sha256: a generation table also records per-run timings.)"""
    return {
        shard: ([p["sha256"] for p in marker_parts(m)], m["rows"], m["dead"])
        for shard, m in ShardStore(run, "extract").committed().items()
    }


def _assert_extracted_once(run: RunFolder) -> None:
    rows, dead = extracted_ids(run)
    assert len(rows) == len(set(rows)) and not set(rows) & set(dead), "a sequence extracted twice"
    generated, gen_dead = assert_exactly_once(run)
    assert len(rows) + len(dead) == generated
    assert unmarked_objects(run, "extract") == set()
    sources = {s: m["sha256"] for s, m in ShardStore(run, "generate").committed().items()}
    assert {s: m["source_sha256"] for s, m in ShardStore(run, "extract").committed().items()} == sources
    # The completion marker names every shard and the generation table it read.
    assert run.read_json("extract/_COMPLETE")["shards"] == sources


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    """One real Prefect server for every CLI run here (an ephemeral API per run costs ~7 s)."""
    with prefect_server(tmp_path_factory.mktemp("overlap-prefect")) as url:
        yield url


@pytest.fixture(scope="module")
def server(tiny_target_dir):
    """One SGLang-compatible server of the tiny target for every run here."""
    proc = ServerProcess(["--model", str(tiny_target_dir)])
    try:
        yield proc.url
    finally:
        proc.stop()


def _fault(url: str, **spec: Any) -> None:
    httpx.post(f"{url}/_fault", json=spec, timeout=30).raise_for_status()


def _wait(proc, done, what: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not done():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def sequential(tmp_path_factory, tiny_target_dir, api_url, server):
    """The uninterrupted sequential run every overlapped run must equal."""
    tmp = tmp_path_factory.mktemp("overlap-sequential")
    params = _params(tmp, tiny_target_dir, "seq", overlap=False, server_url=server)
    log = tmp / "cli.log"
    proc = start_cli(["run", "--params", str(params)], cli_env(tmp, PREFECT_API_URL=api_url), log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    run = RunFolder(str(tmp / "seq/run"))
    clocks = read_status(run)["stages"]
    assert clocks["generate"]["ended_at"] <= clocks["extract"]["started_at"]  # one after the other
    extraction = _extraction(run)
    assert len(extraction) == PROMPTS // SHARD_SIZE  # total_prompts counts after the holdout
    return extraction


def test_overlapped_run_equals_sequential_and_clocks_overlap(tmp_path, tiny_target_dir, api_url, server, sequential):
    params = _params(tmp_path, tiny_target_dir, "ovl", overlap=True, server_url=server)
    log = tmp_path / "cli.log"
    # Every answer 0.2 s late (the same answer): generation's 60 requests take 12 s or more,
    # far longer than extraction needs to load the target and commit a shard, however fast or
    # loaded the machine, so the overlap below is the orchestration's and not a race's.
    _fault(server, mode="slow", delay_s=0.2)
    try:
        proc = start_cli(["run", "--params", str(params)], cli_env(tmp_path, PREFECT_API_URL=api_url), log)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        _fault(server, mode="none")
    run = RunFolder(str(tmp_path / "ovl/run"))
    assert _extraction(run) == sequential
    _assert_extracted_once(run)
    complete = run.read_json("extract/_COMPLETE")
    assert complete["shards_extracted"] == complete["shards_generated"] == len(sequential)
    clocks = read_status(run)["stages"]
    gen, ext = clocks["generate"], clocks["extract"]
    assert gen["state"] == ext["state"] == "completed"
    # Extraction began before generation ended, and ended after generation completed: it waits for
    # generate/_COMPLETE. (Not after generation's clock: the stage ends its clock after writing
    # _COMPLETE, and extraction may finish in between; a fresh clone's run once did, by 0.04 s.)
    completed_at = run.read_json("generate/_COMPLETE")["completed_at"]
    assert ext["started_at"] < gen["ended_at"] and completed_at <= ext["ended_at"], (clocks, completed_at)
    # And it really worked during generation: some shard was committed before generation ended.
    committed_at = [m["committed_at"] for m in ShardStore(run, "extract").committed().values()]
    assert min(committed_at) < gen["ended_at"], (committed_at, gen)
    # Run from a second thread, extract is still a child run of the parent flow run in Prefect.
    flows = {f["id"]: f["name"] for f in httpx.post(f"{api_url}/flows/filter", json={}).json()}
    runs = httpx.post(f"{api_url}/flow_runs/filter", json={}).json()
    parents = {r["id"] for r in runs if flows[r["flow_id"]] == "data-scaling"}
    extracts = [r for r in runs if flows[r["flow_id"]] == "extract"]
    assert len(extracts) == 2 and all(r["state_type"] == "COMPLETED" for r in extracts)  # sequential, overlapped
    tasks = httpx.post(f"{api_url}/task_runs/filter", json={}).json()
    wrapper_of = {t["id"]: t["flow_run_id"] for t in tasks}
    assert all(wrapper_of.get(r["parent_task_run_id"]) in parents for r in extracts), extracts


def test_kill9_while_both_stages_run_then_resume_is_exactly_once(tmp_path, tiny_target_dir, api_url, server, sequential):
    params = _params(tmp_path, tiny_target_dir, "kill", overlap=True, server_url=server)
    run_dir = tmp_path / "kill/run"
    run = RunFolder(str(run_dir))
    log = tmp_path / "cli.log"
    env = cli_env(tmp_path, PREFECT_API_URL=api_url)
    proc = start_cli(["run", "--params", str(params)], env, log)
    gen, ext = ShardStore(run, "generate"), ShardStore(run, "extract")
    # Both stages active at the kill, by construction: once generation has committed a shard,
    # the server holds every later request, so generation cannot end while extraction commits.
    try:
        _wait(proc, lambda: len(gen.committed()) >= 1, "a generation shard")
        _fault(server, mode="hang")
        _wait(proc, lambda: len(ext.committed()) >= 1, "an extraction shard")
        generated = len(gen.committed())
    finally:
        kill_group(proc)
        _fault(server, mode="none")  # the held requests' clients are gone with the run
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert not gen.is_complete() and generated < len(sequential), generated
    extracted = {s: m["attempt"] for s, m in ext.committed().items()}
    assert 1 <= len(extracted) < len(sequential)

    resume = start_cli(["run", "--params", str(params)], env, log)
    assert resume.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert _extraction(run) == sequential
    _assert_extracted_once(run)
    # The shards committed before the kill were not extracted again.
    assert {s: ext.committed()[s]["attempt"] for s in extracted} == extracted
    clocks = read_status(run)["stages"]
    assert clocks["extract"]["attempts"] == clocks["generate"]["attempts"] == 2


def test_generation_failure_stops_extraction_and_fails_the_run(tmp_path, tiny_target_dir, api_url):
    params = _params(
        tmp_path, tiny_target_dir, "fail", overlap=True,
        engine={"kind": "sglang", "endpoints": ["http://127.0.0.1:9"], "health_recheck_s": 0.5},
        generate={"shard_retries": 0, **LEASES},
    )  # fmt: skip
    log = tmp_path / "cli.log"
    proc = start_cli(["run", "--params", str(params)], cli_env(tmp_path, PREFECT_API_URL=api_url), log)
    assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
    run = RunFolder(str(tmp_path / "fail/run"))
    clocks = read_status(run)["stages"]
    assert clocks["generate"]["state"] == "failed" and "Cannot connect" in clocks["generate"]["error"]
    # Extraction was following and stopped on its own once generation had failed.
    assert clocks["extract"]["state"] == "failed" and clocks["extract"]["ended_at"] >= clocks["generate"]["ended_at"]
    assert not run.exists("extract/_COMPLETE")
    assert "Cannot connect" in log.read_text()
