"""P6: wall time of `make demo`'s DAG run (not the install, not the tiny-target build).

Runs `eaglescale run --params deployments/params/smoke.yaml` on a fresh run root with the
ephemeral Prefect API, exactly as `make demo` does, then once more on the same root (a resume
where every shard is already committed). Goal: the fresh run < 3 min on this machine.

    .venv/bin/python benchmarks/p6_demo.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / ".eaglescale" / "tiny-target"


def timed_run(run_root: str) -> tuple[float, float | None, str]:
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--params", "deployments/params/smoke.yaml",
         "--run-root", run_root],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"demo run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    log = proc.stdout + proc.stderr
    # Prefect's own start-up: the ephemeral API server, until the parent flow run begins.
    stamps = re.findall(r"^(\d\d):(\d\d):(\d\d\.\d+) \|.*(Starting temporary server|Beginning flow run)", log, re.M)
    startup = None
    if len(stamps) >= 2:
        secs = [int(h) * 3600 + int(m) * 60 + float(s) for h, m, s, _ in stamps[:2]]
        startup = secs[1] - secs[0]
    return wall, startup, log


def main() -> None:
    if not (TINY / "config.json").exists():
        subprocess.run([sys.executable, "-m", "flows.cli", "tiny-target", str(TINY)], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_root = str(Path(tmp) / "smoke")
        wall, startup, log = timed_run(run_root)
        rows = re.search(r"'rows': (\d+)", log)
        print(f"fresh run : {wall:6.1f} s wall (goal < 180 s); ephemeral API start-up "
              f"{startup if startup is None else round(startup, 1)} s; rows committed {rows.group(1) if rows else '?'}")
        wall2, _, _ = timed_run(run_root)
        print(f"resume run: {wall2:6.1f} s wall (every shard already committed)")


if __name__ == "__main__":
    main()
