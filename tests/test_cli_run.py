"""`eaglescale run` as a user starts it (the installed console script, a subprocess): refusing
bad params before Prefect starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.run_support import ROOT, cli_env

SMOKE = ROOT / "deployments/params/smoke.yaml"
# Prefect's ephemeral API alone takes ~20 s to start here; a refusal comes well before it.
REFUSAL_BOUND_S = 10.0


def _eaglescale() -> list[str]:
    script = Path(sys.executable).with_name("eaglescale")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "flows.cli"]


def _run(args: list[str], cwd: Path, tmp_path: Path, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        [*_eaglescale(), "run", *args], cwd=cwd, env=cli_env(tmp_path), capture_output=True, text=True, timeout=timeout
    )
    return done, time.monotonic() - started


def _refused_before_prefect(done: subprocess.CompletedProcess, elapsed: float) -> None:
    assert done.returncode == 2, done.stderr
    assert elapsed < REFUSAL_BOUND_S, f"took {elapsed:.1f}s: {done.stderr}"
    # The CLI prints this just before it hands over to Prefect.
    assert "PREFECT_API_URL is not set" not in done.stderr


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
