"""Where a run stands, read from its run folder alone, as plain JSON-able data (`read_status`).

No Prefect server is needed, so this works on a crashed run too: the markers are the truth
about committed work, and progress.json's heartbeat tells a live stage from a dead one. The
stages after generation (extraction, training, the gate) are read from their markers and the
small JSON files each writes last. Nothing here renders: tasks/status/render.py draws this
data, tasks/status/command.py is `eaglescale status`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import fsspec
import pyarrow.parquet as pq

from tasks.config import STAGES
from tasks.humanize import duration as format_duration
from tasks.runfolder import LeaseView, RunFolder, ShardStore, holder_label, read_leases
from tasks.runfolder.fingerprint import flatten
from tasks.runfolder.layout import (
    CLOCK_HEARTBEAT_S,
    DISCOVERY_MARKER,
    DISCOVERY_REPORT,
    GATE_DONE,
    GATE_PROGRESS,
    GENERATE_PROGRESS,
    PROMOTED,
    SHARD_PLAN,
    TRAIN_BEST,
    TRAIN_DATA,
    TRAIN_FINAL,
    TRAIN_RESULT,
    stage_clock_key,
)

DEFAULT_STALL_AFTER_S = 900.0
DEFAULT_LEASE_TTL_S = 120.0  # for lease records that do not carry their holder's TTL
STOPPED_AFTER_BEATS = 4  # missed clock heartbeats after which a running stage reads as stopped


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


# ---- discovery and generation ---------------------------------------------------------------


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
    counted count one each), per request not reused from an earlier run (nothing was sent for
    those), and how many were reused."""
    reused = sum(m.get("reused", 0) for m in markers.values())
    generated = sum(m["rows"] + m["dead"] for m in markers.values()) - reused
    sent = sum(m.get("requests_sent", m["rows"] + m["dead"]) for m in markers.values())
    per_request = sent / generated if generated else None
    return {"requests_sent": sent, "sent_per_request": per_request, "reused": reused}


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
    """(state, stall reason): not started | running | stalled | failed | stopped | complete | incomplete."""
    if complete:
        return "complete", None
    if progress is None:
        # committed shards but no progress file: nothing to judge liveness by
        return ("incomplete" if has_markers else "not started"), None
    if progress.get("state") in ("failed", "stopped", "complete"):
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


# ---- the stages after generation ------------------------------------------------------------


def extract_status(run: RunFolder, generated: int, lease_ttl_s: float) -> dict[str, Any] | None:
    store = ShardStore(run, "extract")
    committed = store.committed()
    if not committed and not store.is_complete():
        data = run.read_json(TRAIN_DATA) or {}
        # An online run's trainer captured its states: the stage never runs, nothing is stored.
        return {"online": True} if data.get("hidden_states") == "online" else None
    leased = [f"{v.shard_id}: {v.describe()}" for v in read_leases(run, "extract", lease_ttl_s).values()
              if v.live and v.shard_id not in committed]  # fmt: skip
    return {
        "shards": len(committed),
        "of": generated,
        "sequences": sum(int(m.get("rows", 0)) for m in committed.values()),
        "complete": store.is_complete(),
        "leased": leased,
    }


def train_status(run: RunFolder) -> dict[str, Any] | None:
    best, result = run.read_json(TRAIN_BEST), run.read_json(TRAIN_RESULT)
    if best is None and result is None:
        return None
    best = best or {}
    return {
        "steps": (result or {}).get("steps"),
        "best_step": best.get("step"),
        "best_sim_accept_len": best.get("sim_accept_len"),
        "exported": run.exists(f"{TRAIN_FINAL}/config.json"),
    }


def gate_status(run: RunFolder) -> dict[str, Any] | None:
    """The decision (gate/_SUCCESS.json) and, while a gate runs or after one failed, where it
    is or stopped (gate/progress.json)."""
    done, progress = run.read_json(GATE_DONE), run.read_json(GATE_PROGRESS)
    if done is None and progress is None:
        return None
    summary = (done or {}).get("summary", {})
    promoted = run.read_json(PROMOTED)
    out: dict[str, Any] = {
        "outcome": summary.get("outcome"),
        "speedup": summary.get("speedup"),
        "ci": summary.get("ci"),
        "accept_length": summary.get("accept_length"),
        "message": summary.get("message"),
        "promoted_draft": (promoted or {}).get("draft_id"),
        "progress": None,
    }
    if progress is not None and progress.get("state") != "done":
        out["progress"] = {k: progress.get(k) for k in ("state", "phase", "launches", "current", "message", "updated_at")}
    return out


def stage_clocks(run: RunFolder, now: float | None = None) -> dict[str, Any]:
    """Each stage's clock (stages/<stage>.json, written by the stage flows): state, this
    attempt's started_at / ended_at (UNIX seconds; ended_at null while it runs), the first
    attempt's start and the number of attempts. Stages that never started are left out. A
    clock that says running but whose heartbeat is older than STOPPED_AFTER_BEATS beats is
    "stopped": its process is gone (killed, or the machine lost), and nothing runs it."""
    now = time.time() if now is None else now
    out = {}
    for stage in STAGES:
        clock = _json(run, stage_clock_key(stage))
        if clock is None:
            continue
        view = {k: clock.get(k) for k in ("state", "started_at", "ended_at", "first_started_at", "attempts", "error")
                if k != "error" or clock.get(k)}  # fmt: skip
        beat = clock.get("heartbeat_at")
        if clock.get("state") == "running" and beat is not None:
            age = now - float(beat)
            if age > STOPPED_AFTER_BEATS * float(clock.get("heartbeat_s") or CLOCK_HEARTBEAT_S):
                view.update(state="stopped", heartbeat_age_s=age)
        out[stage] = view
    return out


def later_stages(run: RunFolder, generated: int, lease_ttl_s: float) -> dict[str, Any]:
    return {
        "extract": extract_status(run, generated, lease_ttl_s),
        "train": train_status(run),
        "gate": gate_status(run),
    }


# ---- the whole run --------------------------------------------------------------------------


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
    clocks = stage_clocks(run, now)
    gen_clock = clocks.get("generate") or {}
    if generate["state"] in ("running", "stalled") and gen_clock.get("state") == "stopped":
        # Its process is gone: nothing will move until a resume (still exit 3, like a stall).
        generate.update(state="stopped", stalled=True, stall_reason=(
            f"stopped: no heartbeat from the generate stage for "
            f"{format_duration(gen_clock['heartbeat_age_s'])}; resume the run to go on"))
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
        "stages": clocks,
        "stalled": generate["stalled"],
    }


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
