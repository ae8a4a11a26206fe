"""`eaglescale status RUN_ROOT`: where a run stands, read from its run folder alone
(tasks/status/read.py) and shown as a panel (tasks/status/render.py) or as JSON.

Exit codes: 0 fine, 2 no such run folder (or unreadable), 3 stalled.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml
from rich.console import Console

from tasks.status.read import StatusError, open_run, read_status
from tasks.status.render import render_status

EXIT_OK, EXIT_MISSING, EXIT_STALLED = 0, 2, 3


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
    args = parser.parse_args(argv)
    try:
        run = open_run(args.run_root, _storage_options(args.storage_option))
        status = read_status(run, stall_after_s=args.stall_after)
    except StatusError as e:
        print(f"eaglescale status: {e}", file=sys.stderr)
        return EXIT_MISSING
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True, default=str))
    else:
        Console().print(render_status(status))
    return EXIT_STALLED if status["stalled"] else EXIT_OK
