"""`eaglescale status` for the stages after generation: extraction, training, the gate.

Like the rest of the status command, it reads only the run folder (markers and the small JSON
files each stage writes last), so it works with no Prefect server and on a crashed run.
"""

from __future__ import annotations

from typing import Any

from tasks.config import STAGES
from tasks.notify import format_duration
from tasks.runfolder import RunFolder, ShardStore, read_leases
from tasks.runfolder.layout import (
    GATE_DONE,
    GATE_PROGRESS,
    PROMOTED,
    TRAIN_BEST,
    TRAIN_DATA,
    TRAIN_FINAL,
    TRAIN_RESULT,
    stage_clock_key,
)


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


def stage_clocks(run: RunFolder) -> dict[str, Any]:
    """Each stage's clock (stages/<stage>.json, written by the stage flows): state, this
    attempt's started_at / ended_at (UNIX seconds; ended_at null while it runs), the first
    attempt's start and the number of attempts. Stages that never started are left out."""
    out = {}
    for stage in STAGES:
        clock = run.read_json(stage_clock_key(stage))
        if clock is not None:
            out[stage] = {k: clock.get(k) for k in ("state", "started_at", "ended_at", "first_started_at", "attempts", "error")
                          if k != "error" or clock.get(k)}  # fmt: skip
    return out


def later_stages(run: RunFolder, generated: int, lease_ttl_s: float) -> dict[str, Any]:
    return {
        "extract": extract_status(run, generated, lease_ttl_s),
        "train": train_status(run),
        "gate": gate_status(run),
    }


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def clock_row(clocks: dict[str, Any], now: float) -> tuple[str, str] | None:
    """One row: each stage's state and how long it took (or has been running)."""
    if not clocks:
        return None
    parts = []
    for stage, c in clocks.items():
        end = c["ended_at"] if c["ended_at"] is not None else now
        took = format_duration(max(0.0, end - c["started_at"]))
        parts.append(f"{stage} {took}" if c["state"] == "completed" else f"{stage} {c['state']} {took}")
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
    tr = stages.get("train")
    if tr is not None:
        text = (f"{_fmt(tr['steps'], ',')} steps; best step {_fmt(tr['best_step'], ',')}, "
                f"simulated accept length {_fmt(tr['best_sim_accept_len'], '.3f')}")  # fmt: skip
        rows.append(("train", text + ("; exported" if tr["exported"] else "; not exported yet")))
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
    if gate is not None and gate["outcome"] is not None:
        ci = gate["ci"] or [None, None]
        text = (f"{str(gate['outcome']).upper()}: speedup {_fmt(gate['speedup'], '.3f')}x "
                f"(CI {_fmt(ci[0], '.3f')}–{_fmt(ci[1], '.3f')}), accept length {_fmt(gate['accept_length'], '.2f')}")  # fmt: skip
        rows.append(("gate", text))
        rows.append(("promoted", gate["promoted_draft"] or "none"))
    return rows
