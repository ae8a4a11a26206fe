"""infra/ scripts: --help works, bad arguments are refused, the built command is right."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "infra/sglang/launch_target.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, timeout=30)


def test_help_and_bad_arguments():
    out = _run("--help")
    assert out.returncode == 0 and "--model PATH" in out.stdout
    bad = _run("--modle", "x")
    assert bad.returncode == 2 and "unknown argument '--modle'" in bad.stderr
    missing = _run("--tp", "8")
    assert missing.returncode == 2 and "--model is required" in missing.stderr


def test_dry_run_builds_the_launch_command():
    out = _run("--model", "/models/Kimi-K2.5", "--nccl-ib-disable", "--dry-run", "--", "--log-level", "info")
    assert out.returncode == 0
    assert "NCCL_IB_DISABLE=1" in out.stdout
    cmd = out.stdout.strip().splitlines()[-1]
    assert cmd.startswith("python -m sglang.launch_server --model-path /models/Kimi-K2.5 --tp 8")
    assert cmd.endswith("--trust-remote-code --log-level info")
