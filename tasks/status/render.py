"""`eaglescale status`'s view: the data tasks/status/read.py reads from a run folder, drawn
with rich (a panel of aligned rows, progress bar, server and shard tables)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from tasks.humanize import duration as format_duration
from tasks.status.figures import decision_line, progress_figures, train_figures

SHARD_ROWS_SHOWN = 20
STATE_STYLE = {"complete": "green", "running": "cyan", "stalled": "bold red", "failed": "bold red",
               "stopped": "bold red"}


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


def clock_row(clocks: dict[str, Any], now: float) -> tuple[str, str] | None:
    """One row: each stage's state and how long it took (or has been running)."""
    if not clocks:
        return None
    parts = []
    for stage, c in clocks.items():
        end = c["ended_at"] if c["ended_at"] is not None else now - c.get("heartbeat_age_s", 0.0)
        took = format_duration(max(0.0, end - c["started_at"]))
        if c["state"] == "completed":
            parts.append(f"{stage} {took}")
        elif c["state"] == "stopped":  # the time it ran until its process went away
            parts.append(f"{stage} STOPPED after {took} (no heartbeat for {format_duration(c['heartbeat_age_s'])})")
        else:
            parts.append(f"{stage} {c['state']} {took}")
    return ("stages", " · ".join(parts))


def stage_rows(stages: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows for the status view; stages not started are left out."""
    rows = []
    ext = stages.get("extract")
    if ext is not None and ext.get("online"):
        rows.append(("extract", "skipped: online hidden states (the trainer runs the target; 0 B stored)"))
    elif ext is not None:
        state = "COMPLETE" if ext["complete"] else "running"
        rows.append(("extract", f"{state}: {ext['shards']} / {ext['of']} shards, {ext['sequences']:,} sequences"))
        rows += [("", f"leased: {d}") for d in ext["leased"]]
    train = train_figures(stages.get("train"))
    if train is not None:
        rows.append(("train", train))
    gate = stages.get("gate")
    progress = (gate or {}).get("progress")
    if progress is not None:  # a gate running now, or the last one's failure
        n = progress.get("launches") or {}
        text = (f"{str(progress['state']).upper()}: {progress.get('phase')}, {n.get('done', 0)} / {n.get('planned', 0)} "
                f"launches done ({n.get('failed', 0)} failed)")  # fmt: skip
        rows.append(("gate", text))
        detail = progress.get("current") or (progress.get("message") if progress.get("state") == "failed" else None)
        if detail:
            rows.append(("", str(detail)))
    decision = decision_line(gate)
    if decision is not None:
        rows.append(("gate", decision))
        rows.append(("promoted", (gate or {}).get("promoted_draft") or "none"))
    return rows


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


def _sends(sent: int | None, per_request: float | None, reused: int | None = None) -> str:
    if sent is None or per_request is None:
        line = "—"
    else:
        line = f"{sent:,} requests to the engine, {per_request:.3f} per request"
    # generate.reuse_from: done without a request, so left out of the per-request figure
    return f"{line}; {reused:,} reused from an earlier run" if reused else line


def _throughput(prog: dict[str, Any], now: float, by_state: dict[str, int]) -> Table:
    """A running generation's live figures: the same rows as the generate flow's progress
    artifact and stall alert (tasks/status/figures.py), less the requests and shards rows the
    overview above already shows, plus how many requests were sent."""
    grid = _grid()
    for label, text in progress_figures(prog, now, by_state):
        if label not in ("requests", "shards"):
            grid.add_row(label, text)
    req = prog.get("requests") or {}
    reused = (prog.get("reused") or {}).get("requests")
    grid.add_row("sent", _sends(req.get("sent"), req.get("sent_per_request"), reused))
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
    grid.add_row(
        "sent",
        _sends(committed["requests_sent"], committed["sent_per_request"], committed["reused"]),
    )
    return grid


def _servers(servers: list[dict[str, Any]]) -> Table:
    table = _server_table([s["url"] for s in servers], "healthy", "in flight", "completed", "failures", "last error")
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


def _server_table(urls: list[str], *headers: str) -> Table:
    """A servers table whose first column, the URL, is never wrapped or cut (it is copied from
    here into a curl or a browser): the other columns give way on a narrow terminal."""
    table = Table(title="servers")
    table.add_column("server", no_wrap=True, min_width=max((len(u) for u in urls), default=6))
    for header in headers:
        table.add_column(header, overflow="ellipsis")
    return table


def _run_servers(per_server: dict[str, int], last: list[dict[str, Any]]) -> Table:
    """Who generated a finished run: committed rows per server over every process, with the
    failures the last process saw (its in-flight and health are over)."""
    seen = {s["url"]: s for s in last}
    table = _server_table(list(per_server), "completed", "failures (last process)", "last error")
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
        parts.append(_throughput(prog, status["checked_at"], gen["shards"]["by_state"]))
        if prog.get("servers"):
            parts.append(_servers(prog["servers"]))
    shards = _active_shards(gen["shard_items"])
    if shards is not None:
        parts.append(shards)
    border = {"stalled": "red", "failed": "red", "complete": "green"}.get(gen["state"], "blue")
    return Panel(Group(*parts), title="eaglescale status", border_style=border)
