"""`eaglescale run` as a user starts it (the installed console script, a subprocess): from any
working directory on the shipped smoke profile, and refusing bad params before Prefect starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from tests.run_support import ROOT, cli_env

SMOKE = ROOT / "deployments/params/smoke.yaml"
# Prefect's ephemeral API alone takes ~20 s to start here; a refusal comes well before it.
REFUSAL_BOUND_S = 10.0


def _eaglescale() -> list[str]:
    script = Path(sys.executable).with_name("eaglescale")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "flows.cli"]


def _run(
    args: list[str], cwd: Path, tmp_path: Path, timeout: float = 300, **env_changes: str | None
) -> tuple[subprocess.CompletedProcess, float]:
    # As a user's first run: a fresh Prefect home, whose database the temporary API migrates (with
    # the start-up bound a loaded 2-core machine needs).
    env = cli_env(tmp_path, fresh_prefect_home=True)
    for name, value in env_changes.items():  # None: unset, as on a user's machine
        env.pop(name, None) if value is None else env.update({name: value})
    started = time.monotonic()
    done = subprocess.run([*_eaglescale(), "run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


def _refused_before_prefect(done: subprocess.CompletedProcess, elapsed: float) -> None:
    assert done.returncode == 2, done.stderr
    assert elapsed < REFUSAL_BOUND_S, f"took {elapsed:.1f}s: {done.stderr}"
    # The CLI prints this just before it hands over to Prefect.
    assert "PREFECT_API_URL is not set" not in done.stderr


def test_smoke_profile_runs_from_another_working_directory(tmp_path, tiny_target_dir):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_root = tmp_path / "run"
    # The tiny target is a build output (`make tiny-target`), not part of the checkout, so the
    # session's fixture stands in for it; every other path is the profile's own (relative to
    # deployments/params/).
    done, _ = _run(
        ["--params", str(SMOKE), "--stages", "discover", "--run-root", str(run_root),
         "--set", f"target.model_path={tiny_target_dir}"],
        elsewhere, tmp_path, PREFECT_SERVER_ANALYTICS_ENABLED=None,  # as the README's command runs
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Offline (this machine reaches no analytics host), the temporary API's telemetry was an ERROR.
    assert "telemetry" not in (done.stdout + done.stderr).lower(), done.stderr[-3000:]
    assert (run_root / "prompts/_SUCCESS.json").is_file()
    manifest = pq.read_table(run_root / "prompts/manifest.parquet")
    assert set(manifest.column("source").to_pylist()) >= {"sample-chat", "sample-reasoning", "sample-coding"}
    assert manifest.num_rows > 200
    assert [p.name for p in elsewhere.iterdir()] == []  # nothing written where it started


def test_missing_path_is_named_absolute_with_its_base_before_prefect_starts(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    params = yaml.safe_load(SMOKE.read_text())
    params["target"]["model_path"] = "../models/tiny-target"  # relative to conf/: tmp/models/...
    (conf / "p.yaml").write_text(yaml.safe_dump(params))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done, elapsed = _run(["--params", "../conf/p.yaml", "--run-root", str(tmp_path / "run")], elsewhere, tmp_path)
    _refused_before_prefect(done, elapsed)
    assert f"no model folder or .gguf file at {tmp_path / 'models/tiny-target'}" in done.stderr
    assert f"relative to the folder of the params file ../conf/p.yaml, {conf}" in done.stderr
    # The copied profile's sample prompts point at conf/../../tasks/..., which does not exist.
    assert f"discover.sources[0].path: no file or folder at {tmp_path.parent / 'tasks/data/sample_prompts/general_chat.jsonl'}" in done.stderr
    assert not (tmp_path / "run").exists()


def test_endpoints_for_the_local_engine_are_refused_before_prefect_starts(tmp_path):
    done, elapsed = _run(
        ["--params", str(SMOKE), "--run-root", str(tmp_path / "run"), "--set", "engine.endpoints=[http://host:30000]"],
        tmp_path, tmp_path,
    )  # fmt: skip
    _refused_before_prefect(done, elapsed)
    assert "engine.endpoints lists ['http://host:30000'] but engine.kind is 'local'" in done.stderr
    assert not (tmp_path / "run").exists()
    done, elapsed = _run(["--params", str(SMOKE), "--set", "engine.kind=sglang"], tmp_path, tmp_path)
    _refused_before_prefect(done, elapsed)
    assert "engine.kind is 'sglang' but engine.endpoints is empty" in done.stderr


def test_params_file_not_found_names_its_absolute_path(tmp_path):
    done, elapsed = _run(["--params", "nope/p.yaml"], tmp_path, tmp_path)
    _refused_before_prefect(done, elapsed)
    assert f"nope/p.yaml: params file not found ({tmp_path / 'nope/p.yaml'})" in done.stderr


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, tiny_target_dir):
    run_root = tmp_path / "run"
    done, elapsed = _run(
        ["--params", str(SMOKE), "--run-root", str(run_root), "--dry-run",
         "--set", f"target.model_path={tiny_target_dir}", "--set", "discover.total_prompts=120"],
        tmp_path, tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert elapsed < REFUSAL_BOUND_S and "PREFECT_API_URL is not set" not in done.stderr
    out = done.stdout
    assert "nothing is started" in out and "(a new run folder)" in out
    assert "stages:  discover (not started), generate (not started), extract (not started)" in out
    assert "prompts: 120 × 1 sample(s) (discover.total_prompts (at most))" in out
    assert "shards:  3 of 40 prompts, 0 committed, up to 2 at once per worker" in out
    assert "servers: generation in-process transformers on cpu; gate engine local" in out
    # 120 sequences of at most 512 tokens (extract.max_length) x (8 x 64 + 5) bytes (bf16, hidden 64).
    assert f"disk:    extraction at most 31.8 MB ({120 * 512:,} tokens × 517 B/token, bf16, hidden size 64)" in out
    assert "gate:    the local engine: 4 configs x 3 passes, no launches" in out
    assert not run_root.exists()
    # A server gate's launches and their device time, from the gate's own plan (tasks/gate/plan.py).
    done, _ = _run(
        ["--params", str(SMOKE), "--run-root", str(run_root), "--dry-run", "--set", f"target.model_path={tiny_target_dir}",
         "--set", "gate.engine=emulated", "--set", "gate.concurrency=[1, 8]", "--set", "gate.topk_points=[]"],
        tmp_path, tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # 3 repetitions of the baseline and 3 chains, and the serving policy's pair; 12 prompts at 1, 24 at 8.
    assert "gate:    14 launches (3 baseline, 9 candidate, 2 policy), 504 measured requests at concurrency 1, 8" in done.stdout
