"""Where the runner's files live, here and on the node, and the switches it reads from the
environment: one place, read at call time (`node_env.NODE`, never a copy of it), so that a test
or a rehearsal that sets one reaches every module. Also the few helpers every step shares:
reading a JSON file that may not exist yet, a file's sha256, a command run with its echo.

Standard library only: the pipeline process runs on the node's own Python (no pydantic)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The entry point: the node's helper processes are `python3 -m gpunode node ...` (the Pipeline's
# and `node start`'s), run in REPO, so the command line that starts them is the operator's own.
RUNNER = ("-m", "gpunode")
PROFILE = REPO / "deployments/params/smollm2-sharegpt.yaml"  # `prepare --profile`'s default
LOCAL = REPO / ".eaglescale/h200"  # git-ignored
PAYLOAD = LOCAL / "payload"
NODE = Path(os.environ.get("H200_NODE", "/tmp/h200"))
# A rehearsal on a CPU box (H200_REHEARSAL=1): the same pipeline with the compatible server
# (`eaglescale serve-sglang`, transformers) for generation, the gate's SGLang emulator, this
# venv instead of the bundle, the --set overrides in H200_SETS (JSON list) on every stage, and
# no SpecForge (its loss kernel is Triton-on-GPU only), on the discovered run folder in
# H200_REHEARSAL_RUN (a few prompts: `eaglescale run --stages discover` of a trimmed profile).
REHEARSAL = os.environ.get("H200_REHEARSAL") == "1"
REHEARSAL_RUN = os.environ.get("H200_REHEARSAL_RUN", LOCAL / "src" / "run")
EXTRA_SETS: list[str] = json.loads(os.environ.get("H200_SETS", "[]"))
# The online-incumbent plan's small run, in training sequences (a rehearsal's few prompts need fewer).
SMALL_RUN_SEQUENCES = int(os.environ.get("H200_SMALL_RUN", "1004"))
PORT = 30000  # the generation server's


def node_step(*args: str) -> list[str]:
    """The arguments after `python3` that run `node ARGS...` of this runner (a helper process)."""
    return [*RUNNER, "node", *args]


def out_dir() -> Path:
    """Where a node call leaves what comes back: the device's $OUT (NODE/out without one)."""
    return Path(os.environ.get("OUT", NODE / "out"))


def node_profile() -> Path:
    """The profile the node's steps read: the one the payload was built with (its manifest names
    it), else H200_PROFILE (a rehearsal without a payload), else SmolLM2's."""
    named = (read_json(NODE / "manifest.json") or {}).get("profile") or os.environ.get("H200_PROFILE")
    return REPO / named if named else PROFILE


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def bytes_under(path: Path) -> int:
    """The bytes of a file, or of every file under a folder; 0 when it does not exist."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_command(cmd: list[str], **kw: Any) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)
