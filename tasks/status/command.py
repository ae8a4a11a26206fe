"""`eaglescale status RUN_ROOT`: where a run stands, read from its run folder alone
(tasks/status/read.py) and shown as a panel (tasks/status/render.py) or as JSON.

Exit codes: 0 fine, 2 no such run folder (or unreadable), 3 stalled. `--follow` shows it again
every few seconds until the run is over (0 decided, 1 a stage failed, 3 one stopped).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from typing import Any

import yaml
from rich.console import Console
from rich.live import Live

from tasks.runfolder import RunFolder
from tasks.status.figures import progress_figures, stage_figures
from tasks.status.read import StatusError, open_run, read_status
from tasks.status.render import render_status

EXIT_OK, EXIT_FAILED, EXIT_MISSING, EXIT_STALLED = 0, 1, 2, 3
FOLLOW_EVERY_S = 5.0


def over(status: dict[str, Any]) -> int | None:
    """The exit code of a followed run that is over (the gate decided: 0; a stage failed: 1;
    one stopped, its process gone: 3), or None while it goes on."""
    clocks = status.get("stages") or {}
    if any(c.get("state") == "failed" for c in clocks.values()):
        return EXIT_FAILED
    if any(c.get("state") == "stopped" for c in clocks.values()):
        return EXIT_STALLED
    gate = clocks.get("gate") or {}
    if gate.get("state") == "completed" and (status.get("gate") or {}).get("outcome") is not None:
        return EXIT_OK
    return None


def follow_line(status: dict[str, Any]) -> str:
    """One line for a log or a pipe: the time, each stage's state, and the running stages'
    figures (generation's live ones)."""
    clocks = status.get("stages") or {}
    parts = [f"{name} {c['state']}" for name, c in clocks.items()]
    figures = stage_figures(status)
    gen = status["generate"]
    for name, c in clocks.items():
        if c["state"] != "running":
            continue
        if name == "generate" and gen.get("progress"):
            live = dict(progress_figures(gen["progress"], status["checked_at"], gen["shards"]["by_state"]))
            parts.append(f"generate: {live['requests']}, {live['rate']}, ETA {live['ETA']}")
        elif figures.get(name):
            parts.append(f"{name}: {figures[name]}")
    if figures.get("gate") and (clocks.get("gate") or {}).get("state") == "completed":
        parts.append(f"gate: {figures['gate']}")
    return time.strftime("%H:%M:%S", time.gmtime(status["checked_at"])) + " " + (" · ".join(parts) or "no stage started yet")


def follow(run: RunFolder, status: dict[str, Any], every_s: float, stall_after: float | None, as_json: bool) -> int:
    """Show the status again every `every_s` until the run is over (`over`): redrawn in place on
    a terminal, a line per change elsewhere (a log, a pipe), a JSON object per line with --json."""
    console = Console()
    live = Live(render_status(status), console=console, auto_refresh=False) if console.is_terminal and not as_json else None
    last = ""
    try:
        with live or nullcontext():
            while True:
                if live is not None:
                    live.update(render_status(status), refresh=True)
                else:
                    line = json.dumps(status, sort_keys=True, default=str) if as_json else follow_line(status)
                    if line.split(" ", 1)[-1] != last.split(" ", 1)[-1]:  # the time alone changed: nothing new
                        print(line, flush=True)
                    last = line
                code = over(status)
                if code is not None:
                    return code
                time.sleep(every_s)
                status = read_status(run, stall_after_s=stall_after)
    except KeyboardInterrupt:
        return EXIT_OK


def _storage_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise StatusError(f"--storage-option {pair!r}: expected key=value")
        out[key] = yaml.safe_load(raw) if raw else ""
    return out


def status_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="eaglescale status", description="Show where a run stands."
    )
    parser.add_argument("run_root", metavar="RUN_ROOT", help="run folder: local path or fsspec URL")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.add_argument(
        "--stall-after", type=float, metavar="SECONDS", help="heartbeat age that counts as stalled"
    )
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="K=V",
        help="fsspec option (repeatable)",
    )
    parser.add_argument(
        "--follow", nargs="?", type=float, const=FOLLOW_EVERY_S, metavar="SECONDS",
        help=f"show it again every SECONDS (default {FOLLOW_EVERY_S:g}) until the gate has decided or a stage "
        "failed or stopped (Ctrl-C ends it sooner); exit 0 decided, 1 failed, 3 stopped",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        run = open_run(args.run_root, _storage_options(args.storage_option))
        status = read_status(run, stall_after_s=args.stall_after)
    except StatusError as e:
        print(f"eaglescale status: {e}", file=sys.stderr)
        return EXIT_MISSING
    if args.follow is not None:
        return follow(run, status, args.follow, args.stall_after, args.json)
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True, default=str))
    else:
        Console().print(render_status(status))
    return EXIT_STALLED if status["stalled"] else EXIT_OK
