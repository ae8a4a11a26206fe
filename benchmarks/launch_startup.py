"""Where a gate launch's start-up goes, from the server logs a session brought back:

    .venv/bin/python benchmarks/launch_startup.py RESULTS_DIR [RESULTS_DIR ...] [--tz UTC]

For every launch of each session's gate (run/gate/report.json, or gate/progress.json's finished
launches for a gate cut short), its server log (server-logs/ in results.tar.gz: the start-up
comes back whole) is read as the gate reads it now (tasks.sglang.server_process.parse_server_log's
start-up phases): the seconds from the launch to the server process's first line, to the
scheduler process's first line, to the weights loaded, to the CUDA graphs captured and to ready,
beside the gate's own clock (health_s: its health check answered). The sum over a session says
how much of its gate went to starting processes rather than measuring. `--tz`: the node's time
zone, in which SGLang wrote its times (the nodes so far: UTC).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.real_run_report import Results  # noqa: E402
from tasks.sglang.server_process import parse_server_log  # noqa: E402

PHASES = ("first_line", "server_args", "scheduler", "weights_loaded", "graphs_captured", "ready")


def launches(results: Results) -> list[dict[str, Any]]:
    """The gate's launches with their start and clock: the report's, else a cut-short gate's."""
    report = results.json("run/gate/report.json")
    if report:
        return report["bench"]["launches"]
    return (results.json("run/gate/progress.json") or {}).get("finished", [])


def startup_rows(folder: Path) -> list[dict[str, Any]]:
    results = Results(folder)
    rows = []
    for launch in launches(results):
        if not launch.get("log_path") or launch.get("started_at") is None:
            continue
        text = results.read(f"server-logs/{Path(launch['log_path']).name}")
        if text is None:
            continue
        startup = parse_server_log(text.decode(errors="replace")).startup_s(launch["started_at"])
        rows.append({"config": launch["config"], "repetition": launch.get("repetition"),
                     "health_s": launch.get("health_s"), **{k: startup.get(k) for k in PHASES}})  # fmt: skip
    return rows


def session_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the launches with every phase: seconds to ready, of them before the scheduler's first
    line (processes), loading the weights, capturing graphs, and the rest to ready."""
    whole = [r for r in rows if all(r.get(k) is not None for k in PHASES)]
    if not whole:
        return {"launches": 0}
    total = {"launches": len(whole), "to_ready_s": sum(r["ready"] for r in whole),
             "processes_s": sum(r["scheduler"] for r in whole),
             "weights_s": sum(r["weights_loaded"] - r["scheduler"] for r in whole),
             "graphs_s": sum(r["graphs_captured"] - r["weights_loaded"] for r in whole),
             "after_graphs_s": sum(r["ready"] - r["graphs_captured"] for r in whole)}  # fmt: skip
    total["processes_share"] = total["processes_s"] / total["to_ready_s"]
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="each session's folder of what `node wait` brought back")
    parser.add_argument("--tz", default="UTC", help="the node's time zone, in which SGLang wrote its log times")
    args = parser.parse_args()
    os.environ["TZ"] = args.tz
    time.tzset()
    for folder in args.results:
        rows = startup_rows(folder)
        print(f"{folder}: {len(rows)} launches with their logs")
        print("  config                rep  ready   first-line  scheduler  weights  graphs  (seconds after the launch)")
        for r in rows:
            cells = [f"{r[k]:8.1f}" if r.get(k) is not None else "       -" for k in ("health_s", "first_line", "scheduler",
                                                                                         "weights_loaded", "graphs_captured")]  # fmt: skip
            print(f"  {r['config']:20s} {r['repetition']!s:>3} " + " ".join(cells))
        t = session_totals(rows)
        if t["launches"]:
            print(f"  over {t['launches']} launches: {t['to_ready_s']:.0f} s to ready, {t['processes_s']:.0f} s "
                  f"({t['processes_share']:.0%}) before the scheduler's first line, {t['weights_s']:.0f} s loading "
                  f"weights, {t['graphs_s']:.0f} s capturing graphs, {t['after_graphs_s']:.0f} s after")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
