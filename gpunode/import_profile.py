"""How long SGLang takes to import on the node, and where it goes.

Run 24's gate launches were ready after 61-81 s, and ~50 s of each passed before the scheduler
process wrote its first line (the server logs, BENCHMARKS P31): the server's two
processes importing SGLang, not the model loading. Setup measures that import in the background
(`python -X importtime`), twice, so that the session's results say which modules cost the time
and whether a second import (Python's bytecode cache written by the first) is faster:
sglang-import.json beside measurements.json.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

# What SGLang 0.5.14's scheduler process imports before its first line.
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
IMPORT_PROFILE = "sglang-import.json"  # in the node's folder, beside measurements.json
_LINE = re.compile(r"^import time:\s+(\d+)\s*\|\s*(\d+)\s*\|(\s*)(\S+)\s*$")


def summarize_importtime(stderr: str, top: int = 20) -> dict[str, Any]:
    """`python -X importtime`'s report: the total, each package's share (the modules' own times
    summed by their first dotted name: torch, transformers, sglang, ...) and the slowest modules by
    their own time, in seconds."""
    rows = []
    for line in stderr.splitlines():
        m = _LINE.match(line)
        if m:  # the nesting is the indent after the bar, two spaces a level beyond the first
            rows.append((m.group(4), int(m.group(1)) / 1e6, int(m.group(2)) / 1e6, (len(m.group(3)) - 1) // 2))
    packages: dict[str, float] = {}
    for name, own, _, _ in rows:
        packages[name.split(".")[0]] = packages.get(name.split(".")[0], 0.0) + own
    return {
        "modules": len(rows),
        "total_s": round(sum(cum for _, _, cum, level in rows if level == 0), 3),
        "by_package": [[name, round(t, 3)] for name, t in sorted(packages.items(), key=lambda kv: -kv[1])[:top]],
        "slowest_own": [[name, round(own, 3)] for name, own, _, _ in sorted(rows, key=lambda r: -r[1])[:top]],
    }  # fmt: skip


def profile_import(python: str, env: dict[str, str], module: str = SCHEDULER_MODULE, runs: int = 2,
                   timeout_s: float = 300.0) -> dict[str, Any]:  # fmt: skip
    """`runs` imports of `module` in fresh processes, each timed (wall seconds) with its
    importtime summary; the first may compile the bytecode cache the later ones read."""
    out: dict[str, Any] = {"module": module, "runs": []}
    for _ in range(runs):
        began = time.time()
        try:
            done = subprocess.run([python, "-X", "importtime", "-c", f"import {module}"], env=env,
                                  capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            out["runs"].append({"wall_s": round(time.time() - began, 2), "error": f"timed out after {timeout_s:.0f} s"})
            break
        run: dict[str, Any] = {"wall_s": round(time.time() - began, 2), **summarize_importtime(done.stderr)}
        if done.returncode != 0:
            run["error"] = done.stderr.strip().splitlines()[-1][-500:] if done.stderr.strip() else f"exit {done.returncode}"
        out["runs"].append(run)
    return out


def profile_in_background(python: str, env: dict[str, str], out: Path, module: str = SCHEDULER_MODULE) -> threading.Thread:
    """profile_import in a daemon thread, its result written to `out` (JSON) when done: setup
    does not wait for it."""

    def work() -> None:
        partial = out.with_name(out.name + ".partial")  # renamed when whole: `node wait` may collect meanwhile
        partial.write_text(json.dumps(profile_import(python, env, module), indent=1))
        partial.replace(out)

    thread = threading.Thread(target=work, name="sglang-import-profile", daemon=True)
    thread.start()
    return thread
