"""`eaglescale status RUN_ROOT`: where a run stands, read from its run folder alone.

No Prefect server is needed, so this works on a crashed run too: the markers are the truth
about committed work, and progress.json's heartbeat tells a live stage from a dead one.
Exit codes: 0 fine, 2 no such run folder (or unreadable), 3 stalled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any

import fsspec
import pyarrow.parquet as pq
import yaml
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from tasks.notify import format_duration
from tasks.runfolder import LeaseView, RunFolder, ShardStore, holder_label, read_leases
from tasks.runfolder.fingerprint import flatten
from tasks.runfolder.layout import DISCOVERY_MARKER, DISCOVERY_REPORT, GENERATE_PROGRESS, SHARD_PLAN
from tasks.status_stages import clock_row, later_stages, stage_clocks, stage_rows

DEFAULT_STALL_AFTER_S = 900.0
DEFAULT_LEASE_TTL_S = 120.0  # for lease records that do not carry their holder's TTL
SHARD_ROWS_SHOWN = 20
EXIT_OK, EXIT_MISSING, EXIT_STALLED = 0, 2, 3


class StatusError(RuntimeError):
    """The run folder is missing or a file in it cannot be read; the message names it."""


def _json(run: RunFolder, rel: str) -> Any | None:
    try:
        return run.read_json(rel)
    except ValueError as e:
        raise StatusError(f"{run.url}/{rel}: not valid JSON ({e})") from None


def _short(value: Any) -> Any:
    return value[:77] + "..." if isinstance(value, str) and len(value) > 80 else value


def _parquet_rows(run: RunFolder, rel: str) -> int | None:
    if not run.exists(rel):
        return None
    with run.fs.open(run.path(rel), "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def _discover_status(run: RunFolder) -> dict[str, Any]:
    marker = _json(run, DISCOVERY_MARKER)
    if marker is not None:
        rows = {name: entry.get("rows") for name, entry in marker.get("files", {}).items()}
    else:  # written but not (yet) marked: show what is there, flagged as uncommitted
        rows = {
            n: _parquet_rows(run, f"prompts/{n}.parquet")
            for n in ("manifest", "holdout", "quarantine")
        }
    report = _json(run, DISCOVERY_REPORT) or {}
    return {
        "committed": marker is not None,
        "committed_at": (marker or {}).get("committed_at"),
        "manifest_rows": rows.get("manifest"),
        "holdout_rows": rows.get("holdout"),
        "quarantine_rows": rows.get("quarantine"),
        "totals": report.get("totals"),
        "warnings": len(report.get("warnings", [])),
    }


def _stall(progress: dict[str, Any], now: float, bound: float) -> str | None:
    """Why a running stage looks stalled, or None: its process stopped writing (heartbeat), or
    it writes but no request has finished for longer than the bound."""
    heartbeat_age = now - progress["heartbeat_at"]
    if heartbeat_age > bound:
        return f"no heartbeat for {format_duration(heartbeat_age)} (the generating process is gone or hung)"
    last = (
        progress.get("last_progress_at") or progress.get("started_at") or progress["heartbeat_at"]
    )
    if now - last > bound:
        return f"no request finished for {format_duration(now - last)}"
    return None


def _shard_items(
    planned: dict[str, dict[str, Any]],
    samples: int,
    markers: dict[str, dict[str, Any]],
    live: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Per shard: a marker makes it committed whatever progress.json says (markers are the
    truth); otherwise the last state the generating process published, else pending."""
    items: dict[str, dict[str, Any]] = {}
    for shard_id in sorted(planned.keys() | markers.keys() | live.keys()):
        requests = planned[shard_id]["n_prompts"] * samples if shard_id in planned else None
        if shard_id in markers:
            m = markers[shard_id]
            done = m["rows"] + m["dead"]
            items[shard_id] = {
                "state": "committed",
                "requests": requests,
                "done": done,
                "dead": m["dead"],
            }
        else:
            entry = live.get(shard_id, {})
            items[shard_id] = {
                **entry,
                "state": entry.get("state", "pending"),
                "requests": entry.get("requests", requests),
                "done": entry.get("done", 0),
            }
    return items


def _add_leases(items: dict[str, dict[str, Any]], leases: dict[str, LeaseView]) -> None:
    """Who holds each uncommitted shard. A live lease means some worker is on it (running
    here, or leased by another worker); an expired one means its worker died and the next
    worker to look takes it over, whatever the dead worker's last progress.json said."""
    for shard_id, view in leases.items():
        item = items.get(shard_id)
        if item is None or item["state"] == "committed":
            continue
        item["lease"] = {
            "holder": holder_label(view.holder),
            "epoch": view.epoch,
            "heartbeat_age_s": round(view.heartbeat_age_s, 1),
            "live": view.live,
            "released": view.released,
        }
        item["lease_detail"] = view.describe()
        if view.live and item["state"] != "running":
            item["state"] = "leased"
        elif not view.live and not view.released:
            item["state"] = "lease-expired"


def _generation_started(progress: dict[str, Any] | None, discovered_at: float | None) -> float | None:
    """When generation of the run began: progress.json's first start (kept across resumes),
    else the start of the process that wrote it if that process generated anything, else
    discovery's commit (generation cannot start earlier)."""
    p = progress or {}
    if p.get("first_started_at") is not None:
        return float(p["first_started_at"])
    if (p.get("requests") or {}).get("done_this_run") and p.get("started_at") is not None:
        return float(p["started_at"])
    return discovered_at


def _overall(
    markers: dict[str, dict[str, Any]], progress: dict[str, Any] | None, discovered_at: float | None
) -> dict[str, Any] | None:
    """A finished generation as a whole, from its markers: from its first start to its last
    commit, whatever processes ran in between (the last one may have had nothing left to do,
    so progress.json's rates and ETA say nothing about the run)."""
    if not markers:
        return None
    finished = max(float(m.get("committed_at") or 0.0) for m in markers.values())
    started = _generation_started(progress, discovered_at)
    duration = finished - started if started is not None and started < finished else None
    done = sum(m["rows"] + m["dead"] for m in markers.values())
    tokens = sum(m.get("completion_tokens", 0) for m in markers.values())
    return {
        "started_at": started,
        "finished_at": finished,
        "duration_s": duration,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / duration if duration else None,
        "requests_per_s": done / duration if duration else None,
    }


def _sent(markers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Requests sent to the engine for the committed ones (markers from before sends were
    counted count one each)."""
    done = sum(m["rows"] + m["dead"] for m in markers.values())
    sent = sum(m.get("requests_sent", m["rows"] + m["dead"]) for m in markers.values())
    return {"requests_sent": sent, "sent_per_request": sent / done if done else None}


def _committed_per_server(markers: dict[str, dict[str, Any]]) -> dict[str, int] | None:
    """Committed rows per server over the run; None when a marker predates the count."""
    if not markers or any("servers" not in m for m in markers.values()):
        return None
    per: Counter[str] = Counter()
    for m in markers.values():
        per.update(m["servers"])
    return dict(per)


def _generate_state(
    complete: bool, progress: dict[str, Any] | None, has_markers: bool, now: float, bound: float
) -> tuple[str, str | None]:
    """(state, stall reason): not started | running | stalled | failed | complete | incomplete."""
    if complete:
        return "complete", None
    if progress is None:
        # committed shards but no progress file: nothing to judge liveness by
        return ("incomplete" if has_markers else "not started"), None
    if progress.get("state") in ("failed", "complete"):
        return progress["state"], None
    reason = _stall(progress, now, bound)
    return ("stalled" if reason else "running"), reason


def _generate_status(
    run: RunFolder,
    fingerprint: dict[str, Any],
    now: float,
    stall_after_s: float | None,
    discovered_at: float | None = None,
) -> dict[str, Any]:
    plan = _json(run, SHARD_PLAN) or {}
    planned = {s["shard_id"]: s for s in plan.get("shards", [])}
    samples = int(fingerprint.get("sampling", {}).get("samples_per_prompt", 1))
    markers = ShardStore(run, "generate").committed()
    progress = _json(run, GENERATE_PROGRESS)
    complete = _json(run, "generate/_COMPLETE") if run.exists("generate/_COMPLETE") else None
    items = _shard_items(planned, samples, markers, (progress or {}).get("shards", {}))
    _add_leases(items, read_leases(run, "generate", DEFAULT_LEASE_TTL_S))

    total = sum(i["requests"] or 0 for i in items.values())
    if progress is not None:
        total = max(total, progress.get("requests", {}).get("total", 0))
    done = sum(i["done"] for i in items.values())
    bound = stall_after_s or (progress or {}).get("stall_after_s") or DEFAULT_STALL_AFTER_S
    state, stall_reason = _generate_state(complete is not None, progress, bool(markers), now, bound)
    dead_classes: Counter[str] = Counter()
    for m in markers.values():
        dead_classes.update(m.get("dead_classes", {}))
    progress_view = None
    if progress is not None:
        progress_view = {k: v for k, v in progress.items() if k != "shards"}
        progress_view["heartbeat_age_s"] = now - progress["heartbeat_at"]
    return {
        "state": state,
        "stalled": stall_reason is not None,
        "stall_reason": stall_reason,
        "stall_after_s": bound,
        "completed_at": (complete or {}).get("completed_at"),
        "shards": {
            "planned": len(planned),
            "committed": len(markers),
            "by_state": dict(Counter(i["state"] for i in items.values())),
        },
        "requests": {
            "done": done,
            "total": total,
            "dead": sum(m["dead"] for m in markers.values()),
        },
        "percent": 100.0 * done / total if total else (100.0 if complete else 0.0),
        "committed": {
            "rows": sum(m["rows"] for m in markers.values()),
            "prompt_tokens": sum(m.get("prompt_tokens", 0) for m in markers.values()),
            "completion_tokens": sum(m.get("completion_tokens", 0) for m in markers.values()),
            "dead_classes": dict(dead_classes),
            **_sent(markers),
            "per_server": _committed_per_server(markers),
        },
        "overall": _overall(markers, progress, discovered_at) if state == "complete" else None,
        "progress": progress_view,
        "shard_items": items,
    }


def read_status(
    run: RunFolder, now: float | None = None, stall_after_s: float | None = None
) -> dict[str, Any]:
    """Everything the status view shows, as plain JSON-able data."""
    now = time.time() if now is None else now
    run_json = _json(run, "run.json")
    if run_json is None:
        raise StatusError(
            f"{run.url} has no run.json: not an eaglescale run folder, or no stage has started"
        )
    fingerprint = run_json.get("fingerprint", {})
    discover = _discover_status(run)
    generate = _generate_status(run, fingerprint, now, stall_after_s, discover["committed_at"])
    return {
        "run_root": run.url,
        "checked_at": now,
        "run": {
            "fingerprint_hash": run_json.get("fingerprint_hash"),
            "created_at": run_json.get("created_at"),
            "fingerprint": {k: _short(v) for k, v in flatten(fingerprint).items()},
            "fingerprint_overrides": len(run_json.get("overrides", [])),
        },
        "discover": discover,
        "generate": generate,
        **later_stages(run, generate["shards"]["committed"], DEFAULT_LEASE_TTL_S),
        "stages": stage_clocks(run),
        "stalled": generate["stalled"],
    }


# ---- rendering ------------------------------------------------------------------------------

STATE_STYLE = {"complete": "green", "running": "cyan", "stalled": "bold red", "failed": "bold red"}


def _when(ts: float | None, now: float) -> str:
    if ts is None:
        return "—"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    delta = now - ts
    return f"{stamp} ({format_duration(abs(delta))} {'ago' if delta >= 0 else 'from now'})"


def _num(value: float | None, fmt: str = ",.1f") -> str:
    return "—" if value is None else format(value, fmt)


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", min_width=11)  # the longest label: the grids line up
    grid.add_column()
    return grid


def _overview(status: dict[str, Any]) -> Table:
    now, run, disc, gen = (status[k] for k in ("checked_at", "run", "discover", "generate"))
    grid = _grid()
    grid.add_row("run", status["run_root"])
    fp = run["fingerprint"]
    target = ", ".join(f"{k[7:]}={v}" for k, v in fp.items() if k.startswith("target."))
    grid.add_row("target", target or "—")
    grid.add_row(
        "fingerprint", f"{run['fingerprint_hash']} (started {_when(run['created_at'], now)})"
    )
    if run["fingerprint_overrides"]:
        note = f"{run['fingerprint_overrides']} fingerprint override(s) recorded"
        grid.add_row("", Text(note, style="yellow"))
    prompts = f"{_num(disc['manifest_rows'], ',')} prompts, {_num(disc['holdout_rows'], ',')} "
    prompts += f"holdout, {_num(disc['quarantine_rows'], ',')} quarantined"
    grid.add_row("discover", prompts if disc["committed"] else f"not committed ({prompts})")
    state = gen["state"]
    grid.add_row("generate", Text(state.upper(), style=STATE_STYLE.get(state, "dim")))
    if gen["stall_reason"]:
        grid.add_row("", Text(f"STALLED: {gen['stall_reason']}", style="bold red"))
    req, shards = gen["requests"], gen["shards"]
    done = f"{req['done']:,} / {req['total']:,} ({gen['percent']:.1f}%), {req['dead']:,} dead"
    grid.add_row("requests", done)
    grid.add_row("", ProgressBar(total=max(req["total"], 1), completed=req["done"], width=60))
    states = " · ".join(f"{n} {s}" for s, n in sorted(shards["by_state"].items())) or "none"
    grid.add_row("shards", f"{shards['committed']} / {shards['planned']} committed ({states})")
    for label, text in stage_rows(status):
        grid.add_row(label, text)
    clocks = clock_row(status.get("stages") or {}, now)
    if clocks:
        grid.add_row(*clocks)
    return grid


def _sends(sent: int | None, per_request: float | None) -> str:
    if sent is None or per_request is None:
        return "—"
    return f"{sent:,} requests to the engine, {per_request:.3f} per request"


def _throughput(prog: dict[str, Any], now: float) -> Table:
    rate = prog.get("rate") or {}
    grid = _grid()
    grid.add_row(
        "throughput",
        f"{_num(rate.get('window_tokens_per_s'))} tok/s over the last "
        f"{_num(rate.get('window_s'), '.0f')} s, {_num(rate.get('lifetime_tokens_per_s'))} tok/s "
        f"since start, {_num(rate.get('requests_per_s'), '.2f')} req/s",
    )
    eta = prog.get("eta_s")
    grid.add_row(
        "ETA", "—" if eta is None else f"{format_duration(eta)} → {_when(prog['eta_at'], now)}"
    )
    req = prog.get("requests") or {}
    grid.add_row("sent", _sends(req.get("sent"), req.get("sent_per_request")))
    grid.add_row("heartbeat", _when(prog["heartbeat_at"], now))
    grid.add_row("last result", _when(prog.get("last_progress_at"), now))
    return grid


def _finished(gen: dict[str, Any], now: float) -> Table:
    """A complete generation: its own duration and throughput, not the last process's."""
    overall, committed = gen["overall"], gen["committed"]
    grid = _grid()
    duration = overall["duration_s"]
    took = "—" if duration is None else format_duration(duration)
    grid.add_row(
        "throughput",
        f"{overall['completion_tokens']:,} tokens in {took}: "
        f"{_num(overall['tokens_per_s'])} tok/s, {_num(overall['requests_per_s'], '.2f')} req/s "
        "overall",
    )
    grid.add_row("started", _when(overall["started_at"], now))
    grid.add_row("finished", _when(overall["finished_at"], now))
    grid.add_row("sent", _sends(committed["requests_sent"], committed["sent_per_request"]))
    return grid


def _servers(servers: list[dict[str, Any]]) -> Table:
    table = Table(
        "server", "healthy", "in flight", "completed", "failures", "last error", title="servers"
    )
    for s in servers:
        healthy = Text("yes", style="green") if s["healthy"] else Text("NO", style="bold red")
        table.add_row(
            s["url"],
            healthy,
            str(s.get("in_flight", 0)),
            f"{s.get('completed', 0):,}",
            str(s.get("failures", 0)),
            (s.get("last_error") or "")[:60],
        )
    return table


def _run_servers(per_server: dict[str, int], last: list[dict[str, Any]]) -> Table:
    """Who generated a finished run: committed rows per server over every process, with the
    failures the last process saw (its in-flight and health are over)."""
    seen = {s["url"]: s for s in last}
    table = Table("server", "completed", "failures (last process)", "last error", title="servers")
    for url, rows in sorted(per_server.items(), key=lambda kv: (-kv[1], kv[0])):
        s = seen.get(url, {})
        table.add_row(url, f"{rows:,}", str(s.get("failures", "—")), (s.get("last_error") or "")[:60])
    return table


def _active_shards(items: dict[str, dict[str, Any]]) -> Table | None:
    """Shards neither committed nor pending; failed and unusual states first, since they are
    what a reader came to find. Hundreds of running shards collapse into '+N more'."""
    active = sorted(
        ((k, v) for k, v in items.items() if v["state"] not in ("committed", "pending")),
        key=lambda kv: (kv[1]["state"] in ("running", "leased"), kv[0]),
    )
    if not active:
        return None
    table = Table("shard", "state", "done", "detail", title="active and failed shards")
    for shard_id, item in active[:SHARD_ROWS_SHOWN]:
        style = "" if item["state"] in ("running", "leased") else "red"
        table.add_row(
            shard_id,
            Text(item["state"], style=style),
            f"{item['done']:,} / {_num(item['requests'], ',')}",
            str(item.get("error") or item.get("lease_detail") or "")[:80],
        )
    if len(active) > SHARD_ROWS_SHOWN:
        table.caption = f"+{len(active) - SHARD_ROWS_SHOWN} more"
    return table


def render_status(status: dict[str, Any]) -> RenderableType:
    gen = status["generate"]
    parts: list[RenderableType] = [_overview(status)]
    prog = gen["progress"]
    per_server = gen["committed"]["per_server"]
    if gen.get("overall") is not None:
        parts.append(_finished(gen, status["checked_at"]))
        if per_server:
            parts.append(_run_servers(per_server, (prog or {}).get("servers") or []))
        elif prog is not None and prog.get("servers"):
            parts.append(_servers(prog["servers"]))
    elif prog is not None:
        parts.append(_throughput(prog, status["checked_at"]))
        if prog.get("servers"):
            parts.append(_servers(prog["servers"]))
    shards = _active_shards(gen["shard_items"])
    if shards is not None:
        parts.append(shards)
    border = {"stalled": "red", "failed": "red", "complete": "green"}.get(gen["state"], "blue")
    return Panel(Group(*parts), title="eaglescale status", border_style=border)


# ---- command line ---------------------------------------------------------------------------


def _storage_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise StatusError(f"--storage-option {pair!r}: expected key=value")
        out[key] = yaml.safe_load(raw) if raw else ""
    return out


def open_run(url: str, storage_options: dict[str, Any] | None = None) -> RunFolder:
    """The run folder at `url`, without creating anything when it does not exist."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    if not fs.exists(root):
        raise StatusError(f"run folder {url} does not exist")
    if not fs.exists(f"{root}/run.json"):
        raise StatusError(
            f"{url} has no run.json: not an eaglescale run folder, or no stage has started"
        )
    return RunFolder(url, storage_options)


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
