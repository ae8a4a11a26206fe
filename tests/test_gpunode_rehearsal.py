"""gpunode/rehearsal.sh on this box: a machine that started bare and parts that do not add up are
refused at once, naming what is wrong; parts that do are joined, unpacked and the rehearsal started
as a daemon, and what it left comes back in $OUT. (No SGLang here: the rehearsal runs the gate's
code, from its own copy, up to the first server's launch, which its log, brought back, says.)"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "gpunode/rehearsal.sh"


def rehearsal(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The node's scratch folder (/tmp there) under tmp_path here.
    (tmp_path / "out").mkdir(exist_ok=True)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "REHEARSAL_ROOT": str(tmp_path / "node"),
           "PATH": f"{ROOT / '.venv/bin'}:{os.environ['PATH']}"}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_parts_checked_unpacked_and_the_results_brought_back(tmp_path: Path) -> None:
    site = io.BytesIO()
    with tarfile.open(fileobj=site, mode="w:xz") as tar:
        info = tarfile.TarInfo("marker.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    whole = site.getvalue()
    (tmp_path / "b00").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "b01").write_bytes(whole[len(whole) // 2 :])
    sha = hashlib.sha256(whole).hexdigest()

    bare = rehearsal(tmp_path, "start", sha, "5")
    assert bare.returncode == 3 and "started bare" in bare.stdout
    assert rehearsal(tmp_path, "wait", "5").returncode == 3
    for part in ("b00", "b01"):
        assert rehearsal(tmp_path, "part", str(tmp_path / part)).returncode == 0
    wrong = rehearsal(tmp_path, "start", "0" * 64, "5")
    assert wrong.returncode == 4 and f"add up to {sha}, not {'0' * 64}" in wrong.stdout

    # A file named relative to the working tree reaches the daemon, which runs from a copy.
    replies = "benchmarks/results/real-run-node/run-28/reply-tokens.json"
    done = rehearsal(tmp_path, "start", sha, "60", "--levels", "1", "--prompts", "32", "--reply-tokens", replies)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "started at" in done.stdout and "DONE at" in done.stdout and f"--reply-tokens {ROOT / replies}" in done.stdout
    assert (tmp_path / "node/site/marker.txt").read_text() == "ok"
    assert (tmp_path / "node/es/benchmarks/load_rehearsal.py").exists()
    with tarfile.open(tmp_path / "out/reh.tar.gz") as tar:
        log = tar.extractfile("reh.log")
        text = log.read().decode() if log is not None else ""
    assert f"{tmp_path}/node/es/tasks/gate/benchmark.py" in text  # the daemon ran the copy
    assert "No module named 'sglang'" in text and "before becoming healthy" in text


@pytest.mark.parametrize("args", [[], ["nonsense"]])
def test_anything_else_is_answered_with_the_usage(tmp_path: Path, args: list[str]) -> None:
    said = rehearsal(tmp_path, *args)
    assert said.returncode == 2 and said.stdout.startswith("usage: rehearsal.sh")
