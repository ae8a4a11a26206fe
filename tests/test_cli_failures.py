"""`eaglescale run` ending in a failure the user can fix: the message names the cause and the
fix, the exit code is non-zero, and no traceback buries it. The CLI runs as a subprocess
against a real Prefect server and SGLang-compatible servers on 127.0.0.1, as a user meets it.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest

from flows.cli import EXIT_CONFIG, EXIT_FAILED, _quiet_expected_tracebacks, _run_flow, is_expected
from flows.concurrency import RunRootBusy
from tasks.engines.base import EngineUnavailable
from tasks.errors import ExpectedFailure
from tasks.gate.preflight import PreflightError, draft_tensor_shapes
from tasks.generate.failures import GenerateFailed, ShardFailed, generate_failed
from tasks.runfolder import RunFolder, ShardStore, read_journal
from tasks.standins.faults import FaultSpec
from tasks.standins.server import start_server_thread
from tests.prefect_support import prefect_server
from tests.run_support import ROOT, cli_env, write_params

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as url:
        yield url


def _without_root_powers() -> None:
    """In the child, before exec: drop root's power to write where permissions forbid it
    (CAP_DAC_OVERRIDE, from the bounding set), so a chmod-ed run root refuses root too."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 1, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_DAC_OVERRIDE
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def eaglescale(
    tmp_path: Path, api_url: str, params: Path, *args: str, timeout: float = 540,
    as_user_without_root_powers: bool = False,
) -> subprocess.CompletedProcess:  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--params", str(params), *args],
        cwd=ROOT,
        env=cli_env(tmp_path, PREFECT_API_URL=api_url),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_without_root_powers if as_user_without_root_powers and os.geteuid() == 0 else None,
    )


def failed_cleanly(proc: subprocess.CompletedProcess, code: int) -> str:
    """The CLI's last words, after checking the exit code and that no traceback was printed."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    return proc.stderr[proc.stderr.rindex("eaglescale: ") :]


def sglang_params(tmp_path: Path, model_dir: Path, run_root: Path, url: str, **engine: object) -> Path:
    return write_params(
        tmp_path,
        model_dir,
        str(run_root),
        stages=["discover", "generate"],
        sampling={"max_new_tokens": 16},
        discover={"total_prompts": 80},
        engine={
            "kind": "sglang", "endpoints": [url], "backoff_base_s": 0.01, "backoff_max_s": 0.02,
            "health_recheck_s": 0.2, **engine,
        },
        generate={"shard_size": 40, "shard_retries": 0, "progress_interval_s": 1},
    )  # fmt: skip


def dead_letters(run_root: Path, shard_ids: set[str]) -> Counter[str]:
    """Error classes of the journaled dead letters that no success superseded, in these shards."""
    run = RunFolder(str(run_root))
    classes: Counter[str] = Counter()
    for shard_id in shard_ids:
        records = read_journal(run, "generate", shard_id).records
        ok = {r["request_id"] for r in records if r["status"] == "ok"}
        dead = {r["request_id"]: r["error_class"] for r in records if r["status"] == "dead"}
        classes.update(c for rid, c in dead.items() if rid not in ok)
    return classes


def test_dead_fraction_gives_each_error_class_its_count_and_fix(tmp_path, tiny_target_dir, api_url):
    # A short context overflows the two longest prompts (few enough to pass the door, which
    # refuses a context that leaves more than max_dead_fraction of them without room); 503s on
    # half the requests, with one attempt per round, exhaust some requests' transport retries.
    with start_server_thread(
        step_latency_s=0.0, context_length=250, vocab_size=2048, fault=FaultSpec(mode="5xx", rate=0.5, seed=1)
    ) as server:
        params = sglang_params(tmp_path, tiny_target_dir, tmp_path / "run", server.url, max_attempts=1)
        message = failed_cleanly(eaglescale(tmp_path, api_url, params), EXIT_FAILED)
    # Which requests the 503s hit depends on arrival order, so a shard can stay within the 5%
    # bound (two dead letters of 40) and commit: the message covers the shards the run folder
    # shows uncommitted, and counts their dead letters alone.
    run = RunFolder(str(tmp_path / "run"))
    shards = {s.rstrip("/").rsplit("/", 1)[-1] for s in run.listdir("generate/journal")}
    failed = shards - set(ShardStore(run, "generate").committed())
    classes = dead_letters(tmp_path / "run", failed)
    assert len(shards) == 2 and failed, shards
    assert message.startswith(f"eaglescale: GenerateFailed: generate: {len(failed)} of 2 shards not committed.")
    assert f"{len(failed)} shard(s) over generate.max_dead_fraction (5.0%): " in message
    assert f"{sum(classes.values())} dead letters of {40 * len(failed)} requests:" in message
    assert classes["transport_exhausted"] > 0
    assert classes["context_overflow"] > 0 or "context_overflow" not in message
    lines = message.splitlines()
    transport = next(ln for ln in lines if ln.startswith("  transport_exhausted:"))
    assert transport.startswith(f"  transport_exhausted: {classes['transport_exhausted']} request(s). Fix:")
    assert "generate.retry_dead=true" in transport
    if classes["context_overflow"]:  # the two long prompts' shard failed too (nearly always)
        overflow = next(ln for ln in lines if ln.startswith("  context_overflow:"))
        assert overflow.startswith(f"  context_overflow: {classes['context_overflow']} request(s). Fix:")
        assert "retrying alone sends them into the same limit" in overflow
        assert "raise the server's context length" in overflow
        assert "lower discover.max_prompt_tokens (now 1024)" in overflow
        assert "sampling.max_new_tokens (now 16)" in overflow
        assert "longer than the model's context length (250 tokens)" in message  # an example

    # The same run root with another sampling setting: refused, naming the field.
    again = eaglescale(tmp_path, api_url, params, "--set", "sampling.max_new_tokens=8")
    refused = failed_cleanly(again, EXIT_FAILED)
    assert refused.startswith("eaglescale: FingerprintMismatch: run folder")
    assert "sampling.max_new_tokens: 16 -> 8" in refused


def test_an_unreachable_server_fails_at_once_naming_itself_without_its_credentials(tmp_path, tiny_target_dir, api_url):
    """With the default retries (2 per shard, 30 s apart) and rotation wait (60 s), no server
    answering once took minutes per shard to fail: the door answers it at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://user:s3cret@127.0.0.1:{s.getsockname()[1]}"
    params = sglang_params(tmp_path, tiny_target_dir, tmp_path / "run", url, health_recheck_s=30.0)
    t0 = time.monotonic()
    proc = eaglescale(tmp_path, api_url, params, "--set", "generate.shard_retries=2", timeout=90)
    took = time.monotonic() - t0
    message = failed_cleanly(proc, EXIT_FAILED)
    assert "s3cret" not in proc.stdout + proc.stderr
    assert message.startswith("eaglescale: ServersUnreachable: no generation server answers (http://***@127.0.0.1:")
    assert "Fix: start the servers or correct engine.endpoints" in message
    # One message, not one per shard; then where the run's log file is.
    first, log_line = message.rstrip("\n").split("\n")
    assert log_line.startswith("(log: ") and "/run/logs/eaglescale-" in log_line, message
    assert took < 60, f"{took:.0f} s"  # Prefect's start and discovery included


def test_a_server_of_another_model_stops_the_run_before_any_row(tmp_path, tiny_target_dir, api_url):
    """The issue's server: ids up to 50,000 for a 2,048-token target. It once committed 276
    rows, and extraction found no valid sequence in them. Now its first answer stops the run,
    unretried, before anything is committed."""
    # Every answer at least 8 ids (7 drawn from 50,000, then the stop token): one of a single stop
    # token, or of ids that all happen to fall in the 2,048, is a valid answer, journaled before
    # the first wrong one arrives (a fresh clone's run journaled 2 that way).
    with start_server_thread(step_latency_s=0.0, vocab_size=50000, min_new_fraction=0.5) as server:
        params = sglang_params(tmp_path, tiny_target_dir, tmp_path / "run", server.url)
        proc = eaglescale(tmp_path, api_url, params, "--set", "generate.shard_retries=2")
        sent = server.server.requests.get("generate", 0)
    message = failed_cleanly(proc, EXIT_FAILED)
    assert message.startswith(f"eaglescale: WrongModel: {server.url} answered token id ")
    assert "outside the target's vocabulary of 2048 ids" in message
    assert sent <= 80  # at most one attempt per planned request: no shard was retried
    run = RunFolder(str(tmp_path / "run"))
    assert run.listdir("generate/data") == [] and not run.exists("generate/_COMPLETE")
    assert sum(len(read_journal(run, "generate", s).records) for s in run.listdir("generate/journal")) == 0


def test_a_read_only_run_root_fails_at_once_with_one_message(tmp_path, tiny_target_dir, api_url):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o555)
    params = sglang_params(tmp_path, tiny_target_dir, run_dir, "http://127.0.0.1:9")
    t0 = time.monotonic()
    proc = eaglescale(tmp_path, api_url, params, as_user_without_root_powers=True, timeout=60)
    took = time.monotonic() - t0
    message = failed_cleanly(proc, EXIT_FAILED)
    assert message.startswith(f"eaglescale: RunRootUnwritable: run root {run_dir} refuses writes (permission denied")
    assert message.count("\n") == 1, message
    assert took < 15, f"{took:.0f} s"  # refused before Prefect starts


def test_a_missing_source_is_a_config_error(tmp_path, tiny_target_dir, api_url):
    params = write_params(
        tmp_path,
        tiny_target_dir,
        str(tmp_path / "run"),
        stages=["discover"],
        discover={"sources": [{"name": "gone", "path": str(tmp_path / "nope.jsonl"), "domain": "chat"}]},
    )
    message = failed_cleanly(eaglescale(tmp_path, api_url, params), EXIT_CONFIG)
    # Refused by the pre-start check of the stages' inputs, with the path it looked for.
    assert message.startswith("eaglescale: missing input paths:")
    assert f"discover.sources[0].path: no file or folder at {tmp_path / 'nope.jsonl'}" in message


def test_a_disk_forecast_that_does_not_fit_is_refused(tmp_path, tiny_target_dir, api_url):
    with start_server_thread(step_latency_s=0.0, vocab_size=2048) as server:
        params = sglang_params(tmp_path, tiny_target_dir, tmp_path / "run", server.url)
        proc = eaglescale(
            tmp_path, api_url, params, "--stages", "discover,generate,extract",
            "--set", "extract.quota_bytes=1000",
        )  # fmt: skip
    message = failed_cleanly(proc, EXIT_FAILED)
    assert message.startswith("eaglescale: DiskForecastError: extraction needs")
    assert "(1,000 bytes)" in message


def test_which_failures_are_expected(tmp_path: Path) -> None:
    with pytest.raises(PreflightError) as refused:  # the gate's preflight on an empty draft folder
        draft_tensor_shapes(fsspec.filesystem("file"), str(tmp_path))
    shard = ShardFailed("shard s1: 3 of 4 dead", "s1", 4, {"context_overflow": 3}, {"context_overflow": "too long"})
    copy = pickle.loads(pickle.dumps(shard))  # Prefect may persist task exceptions
    assert (str(copy), copy.planned, copy.dead_classes, copy.examples) == (
        str(shard), 4, {"context_overflow": 3}, {"context_overflow": "too long"},
    )  # fmt: skip
    for exc in (shard, EngineUnavailable("gone"), refused.value, RunRootBusy("held")):
        assert is_expected(exc)
    both = generate_failed({"s1": shard, "s2": EngineUnavailable("gone")}, 3, 0.05)
    assert is_expected(both) and is_expected(pickle.loads(pickle.dumps(both)))
    assert "1 shard(s) over generate.max_dead_fraction (5.0%): 3 dead letters of 4 requests" in str(both)
    # One shard that failed for an unforeseen reason makes the whole failure unexpected.
    assert not is_expected(generate_failed({"s1": shard, "s2": KeyError("x")}, 3, 0.05))
    assert not is_expected(GenerateFailed("no causes"))
    assert not is_expected(KeyError("x")) and not is_expected(RuntimeError("x"))


# Every failure the CLI reports as a message alone, with the built-in base its callers catch.
# Once a tuple in flows/cli.py: a class dropped from this list, or from the base, is a test
# change, not a silent traceback.
EXPECTED_FAILURES = [
    ("flows.concurrency", "RunRootBusy", RuntimeError),
    ("flows.concurrency", "GpuLimitError", RuntimeError),
    ("tasks.config", "ConfigError", ValueError),  # also discovery's source and mixture errors
    ("tasks.draft.target_heads", "TargetHeadsError", ValueError),
    ("tasks.draft.trainer", "TrainError", RuntimeError),
    ("tasks.engines.base", "EngineUnavailable", RuntimeError),
    ("tasks.engines.base", "WrongModel", RuntimeError),
    ("tasks.engines.base", "ServersUnreachable", RuntimeError),
    ("tasks.extract.capture", "LayerIdError", ValueError),
    ("tasks.extract.forecast", "DiskForecastError", RuntimeError),
    ("tasks.extract.sequences", "ChatTemplateMismatch", RuntimeError),
    ("tasks.gate.plan", "GateStopped", RuntimeError),
    ("tasks.gate.preflight", "PreflightError", ValueError),
    ("tasks.gate.promote", "PromotionError", RuntimeError),
    ("tasks.generate.failures", "ShardFailed", RuntimeError),
    ("tasks.runfolder", "CorruptShard", RuntimeError),  # through CommitError, kept
    ("tasks.runfolder", "FingerprintMismatch", RuntimeError),
    ("tasks.runfolder", "RunRootUnwritable", RuntimeError),
    ("tasks.sglang.server_process", "ServerStartError", RuntimeError),
    ("tasks.sglang.versions", "LaunchError", ValueError),
    ("tasks.target.model_dir", "TargetError", ValueError),
    ("tasks.target.packages", "PackagePathError", ValueError),
]


@pytest.mark.parametrize(("module", "name", "builtin"), EXPECTED_FAILURES, ids=[n for _, n, _ in EXPECTED_FAILURES])
def test_each_expected_failure_derives_from_the_base_and_keeps_its_own(module: str, name: str, builtin: type) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, ExpectedFailure), f"{module}.{name} no longer derives from tasks.errors.ExpectedFailure"
    assert issubclass(cls, builtin)  # every `except ValueError` / `except RuntimeError` still catches it
    assert is_expected(cls.__new__(cls))


def test_an_expected_failure_from_deep_inside_a_stage_prints_without_a_traceback(tmp_path, monkeypatch, capsys):
    """The CLI names no class any more: one it never heard of, raised three calls down a stage,
    is reported by the base alone, in one line; Prefect's log of the failed task drops its
    traceback. An unforeseen failure keeps its traceback."""
    import flows.data_scaling

    class StageRefused(RuntimeError, ExpectedFailure):
        pass

    def shard(failure: Exception) -> None:
        raise failure

    def stage(failure: Exception) -> None:
        shard(failure)

    config = SimpleNamespace(run_root=str(tmp_path / "run"))
    refused = StageRefused("shard s1: refused; fix: the fix")
    monkeypatch.setattr(flows.data_scaling, "data_scaling", lambda _: stage(refused))
    assert _run_flow(config) == EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("eaglescale: StageRefused: shard s1: refused; fix: the fix\n(log: "), err
    assert "Traceback" not in err

    _quiet_expected_tracebacks()  # as _run_flow left it: Prefect's task-run logger filters
    task_runs = logging.getLogger("prefect.task_runs")

    def logged(exc: BaseException) -> logging.LogRecord:
        info = (type(exc), exc, None)
        record = task_runs.makeRecord(task_runs.name, logging.ERROR, __file__, 0, "Task run failed", (), info)
        assert task_runs.filter(record)  # the line itself is kept
        return record

    assert logged(refused).exc_info is None and logged(KeyError("x")).exc_info is not None

    monkeypatch.setattr(flows.data_scaling, "data_scaling", lambda _: stage(KeyError("x")))
    assert _run_flow(config) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "Traceback" in err and "eaglescale: run failed: KeyError: 'x'" in err
