"""The figures a watcher reads at a glance, as (label, text) rows, from what the run folder
holds: generation's live progress (generate/progress.json) and each stage's key numbers (the
status tasks/status/read.py reads). One source for every place a person looks: `eaglescale
status`, the generate flow's live progress artifact and its stall alert (flows/views.py,
flows/generate.py) and the parent run's summary artifact. Plain text, no rich.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tasks.humanize as h

Rows = list[tuple[str, str]]
# The order a shard's states are listed in: done first, then what moves, then what waits.
SHARD_STATE_ORDER = ("committed", "running", "leased", "lease-expired", "pending", "failed", "stopped")


def shard_line(by_state: Mapping[str, int], total: int | None = None) -> str:
    """`3 committed · 2 running · 4 pending (of 9)`."""
    order = {s: i for i, s in enumerate(SHARD_STATE_ORDER)}
    parts = [f"{n:,} {s}" for s, n in sorted(by_state.items(), key=lambda kv: (order.get(kv[0], 99), kv[0])) if n]
    total = sum(by_state.values()) if total is None else total
    return (" · ".join(parts) or "none") + f" (of {total:,})"


def servers_line(servers: list[Mapping[str, Any]]) -> str:
    """`2 / 2 up`, or which are down and why."""
    if not servers:
        return h.DASH
    down = [s for s in servers if not s.get("healthy")]
    line = f"{len(servers) - len(down)} / {len(servers)} up"
    if down:
        line += "; down: " + ", ".join(f"{s['url']} ({(s.get('last_error') or 'no answer')[:80]})" for s in down)
    return line


def dead_line(total: int, classes: Mapping[str, int] | None) -> str:
    """`3: context_overflow 2, http_503 1`, or `none`."""
    if not total:
        return "none"
    return f"{total:,}" + (f": {h.counts(classes)}" if classes else "")


def progress_figures(progress: Mapping[str, Any], now: float, by_state: Mapping[str, int] | None = None) -> Rows:
    """Generation's live figures from a progress.json snapshot: requests done / total, tokens,
    rate, ETA, dead letters by class, shards by state (`by_state` where the markers and leases
    say better, as status reads them), servers up, heartbeat and last result."""
    req, tok, rate = (progress.get(k) or {} for k in ("requests", "tokens", "rate"))
    eta = progress.get("eta_s")
    window = rate.get("window_s")
    if window and progress.get("started_at") and progress.get("updated_at"):
        # A process younger than the window measured its rate over its age (window_rate): say so.
        window = min(window, max(0.0, progress["updated_at"] - progress["started_at"]))
    states = by_state if by_state is not None else (progress.get("shard_counts") or {})
    rows: Rows = [
        ("requests", f"{h.number(req.get('done'))} / {h.number(req.get('total'))} ({h.percent((progress.get('percent') or 0) / 100)})"),
        ("tokens", f"{h.number(tok.get('completion_done'))} generated of ~{h.number(tok.get('completion_total_estimate'))}; "
                   f"{h.number(tok.get('prompt_done'))} prompt tokens"),
        ("rate", f"{h.number(rate.get('window_tokens_per_s'))} tok/s, {h.number(rate.get('requests_per_s'), 3)} req/s"
                 + (f" (last {h.duration(window)})" if window else "")),
        ("ETA", h.DASH if eta is None else f"{h.duration(eta)}, at {h.clock(progress.get('eta_at'))}"),
        ("dead letters", dead_line(int(req.get("dead") or 0), progress.get("dead_classes"))),
        ("shards", shard_line(states)),
        ("servers", servers_line(progress.get("servers") or [])),
        ("heartbeat", h.ago(progress.get("heartbeat_at"), now)),
        ("last result", h.ago(progress.get("last_progress_at"), now)),
    ]  # fmt: skip
    return rows


def progress_markdown(progress: Mapping[str, Any], now: float, title: str, run_root: str) -> str:
    """The figures as a two-column markdown table under `title` (the UI's live view)."""
    state = str(progress.get("state") or "running")
    lines = [f"# {title}", "", f"**{state.upper()}** · updated {h.clock(now)} · run folder `{run_root}`", "",
             "| | |", "|---|---|"]  # fmt: skip
    lines += [f"| {label} | {text.replace('|', '/')} |" for label, text in progress_figures(progress, now)]
    return "\n".join(lines) + "\n"


# ---- each stage's key numbers, from `read_status` ------------------------------------------


def discover_figures(d: Mapping[str, Any]) -> str | None:
    if not d.get("committed"):
        return None
    totals = d.get("totals") or {}
    read = f" of {h.number(totals['rows_read'])} read" if totals.get("rows_read") is not None else ""
    return f"{h.number(d.get('manifest_rows'))} prompts{read}, {h.number(d.get('holdout_rows'))} held out"


def generate_figures(g: Mapping[str, Any]) -> str | None:
    if g.get("state") == "not started":
        return None
    req, shards = g["requests"], g["shards"]
    done = f"{h.number(req['done'])} / {h.number(req['total'])} requests"
    tokens = h.number(g["committed"]["completion_tokens"])
    dead = dead_line(req["dead"], g["committed"].get("dead_classes"))
    return f"{done}, {shards['committed']} / {shards['planned']} shards, {tokens} tokens, dead letters {dead}"


def extract_figures(e: Mapping[str, Any] | None) -> str | None:
    if e is None:
        return None
    if e.get("online"):
        return "skipped: online hidden states (the trainer runs the target; nothing stored)"
    return f"{h.number(e['sequences'])} sequences in {e['shards']} / {e['of']} shards"


def train_figures(t: Mapping[str, Any] | None) -> str | None:
    if t is None:
        return None
    line = (f"{h.number(t['steps'])} steps; best step {h.number(t['best_step'])}, "
            f"simulated accept length {h.number(t['best_sim_accept_len'], 3)}")  # fmt: skip
    return line + ("; exported" if t["exported"] else "; not exported yet")


def decision_line(g: Mapping[str, Any] | None) -> str | None:
    """`REJECT: speedup 0.839x [0.685, 1.38], accept length 1.15`; None before a decision."""
    if g is None or g.get("outcome") is None:
        return None
    ci = g.get("ci") or [None, None]
    parts = [f"speedup {h.speedup(g['speedup'], *ci)}"] if g.get("speedup") is not None else []
    if g.get("accept_length") is not None:
        parts.append(f"accept length {h.fixed(g['accept_length'])}")
    return str(g["outcome"]).upper() + (": " + ", ".join(parts) if parts else "")


def stage_figures(status: Mapping[str, Any]) -> dict[str, str | None]:
    """Each stage's key numbers in a line (None: nothing to show yet)."""
    return {
        "discover": discover_figures(status["discover"]),
        "generate": generate_figures(status["generate"]),
        "extract": extract_figures(status.get("extract")),
        "train": train_figures(status.get("train")),
        "gate": decision_line(status.get("gate")),
    }
