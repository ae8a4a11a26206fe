"""P6: wall time of `make demo`'s DAG run (not the install, not the tiny-target build).

Runs `eaglescale run --params deployments/params/smoke.yaml` on a fresh run root as `make demo`
does, then once more on the same root (a resume). Goal: the fresh run < 3 min on this machine.
With --overlap: fresh runs, sequential and with `orchestration.overlap=true`, side by side
(`side_by_side`: each stage's clock and the goal), --pairs times. Figures: BENCHMARKS.md, P6.

    .venv/bin/python benchmarks/p6_demo.py
    .venv/bin/python benchmarks/p6_demo.py --overlap --pairs 3   # sequential vs orchestration.overlap
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / ".eaglescale" / "tiny-target"


def timed_run(run_root: str, *overrides: str) -> tuple[float, float | None, str]:
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--params", "deployments/params/smoke.yaml",
         "--run-root", run_root, *[a for o in overrides for a in ("--set", o)]],
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


def stage_seconds(run_root: str) -> dict[str, tuple[float, float]]:
    """stage -> (start, end), UNIX seconds, from the run folder's stage clocks."""
    sys.path.insert(0, str(ROOT))
    from tasks.runfolder import RunFolder
    from tasks.status.read import read_status

    return {k: (c["started_at"], c["ended_at"]) for k, c in read_status(RunFolder(run_root))["stages"].items()}


MODES = {"sequential": (), "overlapped": ("orchestration.overlap=true",)}


def side_by_side(pair: int) -> dict[str, float]:
    """One sequential and one overlapped fresh run (the order alternates between pairs, so a
    load that drifts does not always favour the same mode), printed side by side."""
    order = list(MODES) if pair % 2 == 0 else list(MODES)[::-1]
    with tempfile.TemporaryDirectory() as tmp:
        walls, clocks = {}, {}
        for name in order:
            root = str(Path(tmp) / name)
            walls[name] = timed_run(root, *MODES[name])[0]
            clocks[name] = stage_seconds(root)
    seq = {k: end - start for k, (start, end) in clocks["sequential"].items()}
    print(f"pair {pair + 1} ({' first, '.join(order)} second)")
    print(f"{'stage':<10}{'sequential':>24}{'overlapped':>24}   (start - end (length), s after discover began)")
    for stage in seq:
        cells = []
        for name in MODES:
            t0 = min(start for start, _ in clocks[name].values())
            start, end = clocks[name][stage]
            cells.append(f"{start - t0:7.1f} - {end - t0:6.1f} ({end - start:5.1f})")
        print(f"{stage:<10}{cells[0]:>24}{cells[1]:>24}")
    span = {n: max(e for _, e in c.values()) - min(s for s, _ in c.values()) for n, c in clocks.items()}
    # generate and extract together: from the first of them to start to the last to end.
    window = {n: max(c["generate"][1], c["extract"][1]) - min(c["generate"][0], c["extract"][0]) for n, c in clocks.items()}
    # Goal: <= 1.15 x (the longer of generate/extract, from the sequential run, + what cannot
    # overlap, from the overlapped run itself: training's length swings with the box's load).
    ovl = {k: end - start for k, (start, end) in clocks["overlapped"].items()}
    longest = max(seq["generate"], seq["extract"])
    bound = ovl["discover"] + longest + ovl["train"] + ovl["gate"]
    print(f"{'wall':<10}{walls['sequential']:>22.1f} s{walls['overlapped']:>22.1f} s")
    print(f"{'stages':<10}{span['sequential']:>22.1f} s{span['overlapped']:>22.1f} s   (first stage start -> last stage end)")
    print(f"{'gen+ext':<10}{window['sequential']:>22.1f} s{window['overlapped']:>22.1f} s")
    print(f"goal: overlapped stages <= 1.15 x {bound:.1f} s = {1.15 * bound:.1f} s; "
          f"generate+extract <= 1.15 x {longest:.1f} s = {1.15 * longest:.1f} s\n")
    return {"seq_wall": walls["sequential"], "ovl_wall": walls["overlapped"], "seq_window": window["sequential"],
            "ovl_window": window["overlapped"], "ovl_span": span["overlapped"], "goal": 1.15 * bound,
            "window_goal": 1.15 * longest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overlap", action="store_true", help="sequential vs overlapped fresh runs, side by side")
    parser.add_argument("--pairs", type=int, default=1, help="with --overlap: pairs of runs (medians printed)")
    args = parser.parse_args()
    if not (TINY / "config.json").exists():
        subprocess.run([sys.executable, "-m", "flows.cli", "tiny-target", str(TINY)], cwd=ROOT, check=True)
    if args.overlap:
        runs = [side_by_side(i) for i in range(args.pairs)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"median of {len(runs)}: wall {med['seq_wall']:.1f} s sequential, {med['ovl_wall']:.1f} s overlapped; "
              f"generate+extract {med['seq_window']:.1f} s -> {med['ovl_window']:.1f} s; overlapped stages "
              f"{med['ovl_span']:.1f} s vs goal {med['goal']:.1f} s; goals met (stages, generate+extract) in "
              f"{sum(r['ovl_span'] <= r['goal'] for r in runs)}, {sum(r['ovl_window'] <= r['window_goal'] for r in runs)} "
              f"of {len(runs)} pairs")
        return
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
