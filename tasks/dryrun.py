"""`eaglescale run --dry-run`: what a run would do, read from its config and run folder, with
nothing started (no Prefect server, no model load, no engine, nothing written).

The plan: the stages that would run and how far each already is, the prompts and shards
(counted from a committed discovery, else projected from the config), the servers generation
would use, and the disk the extraction would take against what the destination holds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import fsspec

from tasks.config import EagleScaleConfig
from tasks.discover.domains import max_prompt_tokens
from tasks.extract.sizes import bytes_per_token, free_bytes_at, human_bytes
from tasks.redaction import redact_url
from tasks.runfolder import RunFolder, ShardStore
from tasks.runfolder.layout import (
    DISCOVERY_MARKER,
    GATE_DONE,
    SHARD_PLAN,
    SYNTHESIS_STAGE,
    TRAIN_RESULT,
    stage_clock_key,
)


def _existing_run(cfg: EagleScaleConfig) -> RunFolder | None:
    fs, root = fsspec.core.url_to_fs(cfg.run_root, **(cfg.storage_options or {}))
    return RunFolder(cfg.run_root, cfg.storage_options) if fs.exists(root) else None


def _hidden_size(model_path: str) -> int | None:
    """From the target's config.json when it is a folder; None otherwise (a hub id or a GGUF
    file would need loading or converting, which a dry run does not do)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("hidden_size") or (data.get("text_config") or {}).get("hidden_size")


def plan_run(cfg: EagleScaleConfig) -> dict[str, Any]:
    run = _existing_run(cfg)
    plan: dict[str, Any] = {"run_root": redact_url(cfg.run_root), "exists": run is not None,
                            "stages": list(cfg.stages), "done": {}}  # fmt: skip
    marker = run.read_json(DISCOVERY_MARKER) if run else None
    samples = cfg.sampling.samples_per_prompt
    shard_size = cfg.generate.shard_size
    if marker is not None:
        prompts = int(marker["files"]["manifest"]["rows"])
        shard_plan = (run.read_json(SHARD_PLAN) if run else None) or {}
        shards = len(shard_plan.get("shards", [])) or math.ceil(prompts / shard_size)
        basis = "committed discovery"
    elif cfg.discover.total_prompts is not None:
        prompts = cfg.discover.total_prompts
        shards, basis = math.ceil(prompts / shard_size), "discover.total_prompts (at most)"
    else:
        prompts, shards, basis = None, None, "unknown until discovery reads the sources"
    committed = len(ShardStore(run, "generate").committed()) if run else 0
    plan["prompts"] = {"count": prompts, "samples_per_prompt": samples, "basis": basis}
    plan["shards"] = {"planned": shards, "shard_size": shard_size, "committed": committed,
                      "max_parallel": cfg.generate.max_parallel_shards}  # fmt: skip
    for stage in cfg.stages:
        clock = run.read_json(stage_clock_key(stage)) if run else None
        plan["done"][stage] = (clock or {}).get("state", "not started")
    train_result = run.read_json(TRAIN_RESULT) if run else None
    if train_result is not None:
        plan["done"]["train"] = f"{plan['done'].get('train')} ({train_result.get('steps')} steps)"
    if run is not None and run.exists(GATE_DONE):
        plan["done"]["gate"] = "decided"
    e = cfg.engine
    if e.kind == "sglang":
        servers = [redact_url(u) for u in e.endpoints]
        plan["servers"] = {"generation": servers, "kind": e.endpoint_kind,
                           "in_flight_per_server": e.concurrency_per_server}  # fmt: skip
    else:
        plan["servers"] = {"generation": [f"in-process transformers on {e.device}"]}
    plan["servers"]["gate"] = cfg.gate.engine
    plan["disk"] = _disk(cfg, run, prompts)
    plan["gate"] = _gate(cfg)
    synthesized = cfg.discover.synthesized()
    if synthesized:  # written by discover, through generation's engine, before it reads the sources
        plan["synthesis"] = {"requests": sum(int(src.count or 0) for src in synthesized),
                             "sources": {src.name: src.count for src in synthesized},
                             "committed_shards": len(ShardStore(run, SYNTHESIS_STAGE).committed()) if run else 0}  # fmt: skip
    return plan


def _gate(cfg: EagleScaleConfig) -> dict[str, Any]:
    """The gate's launches and a forecast of their device time (tasks/gate/plan.py); the
    incumbent, challengers and data-scaling drafts are counted only when their number is known
    from the config (challengers, train.scaling_fractions)."""
    from tasks.gate.plan import CHALLENGER, SCALING, ExtraDraft, forecast_launches

    gate = cfg.gate
    if gate.engine == "local":
        return {"summary": f"the local engine: {len(gate.num_steps) + 1} configs x {gate.repetitions} passes, no launches"}
    extra = [ExtraDraft(c.name, c.path, c.num_steps, c.topk, c.num_draft_tokens, CHALLENGER) for c in gate.challengers]
    extra += [ExtraDraft(f"scaling-{f}", "DRAFT", gate.scaling_num_steps, role=SCALING) for f in cfg.train.scaling_fractions or []]
    f = forecast_launches(gate, extra=extra)
    roles = ", ".join(f"{n} {role}" for role, n in f.launches.items())
    summary = (f"{f.total} launches ({roles}), {f.requests:,} measured requests at concurrency "
               f"{', '.join(map(str, gate.concurrency))}; ~{f.device_s / 60:.0f} device-minutes at "
               f"{gate.forecast_launch_s:g} s a start-up and {gate.forecast_tok_s:g} tok/s a request (an incumbent adds its own)")
    return {"launches": f.launches, "total": f.total, "requests": f.requests, "device_s": f.device_s, "summary": summary}


def _disk(cfg: EagleScaleConfig, run: RunFolder | None, prompts: int | None) -> dict[str, Any]:
    ex = cfg.extract
    if cfg.train.hidden_states == "online":
        return {"extract_bytes": 0, "summary": "0 B: online hidden states, nothing stored"}
    hidden = _hidden_size(cfg.target.model_path)
    if hidden is None or prompts is None:
        return {"extract_bytes": None, "summary": "unknown (the target's hidden size or the prompt count is not known before a load or discovery)"}
    # Every sequence at its longest: the prompt bound plus the response bound, cut at
    # extract.max_length. The forecast at extraction's start uses the real token counts.
    per_seq = min(max_prompt_tokens(cfg.discover) + cfg.sampling.max_new_tokens_for() + 1, ex.max_length)
    tokens = prompts * cfg.sampling.samples_per_prompt * per_seq
    per_token = bytes_per_token(hidden, ex.storage_dtype)
    total = tokens * per_token
    if ex.quota_bytes is not None:
        limit, name = ex.quota_bytes, "extract.quota_bytes"
    elif run is None or run.is_local:
        limit, path = free_bytes_at(Path(cfg.run_root))
        name = f"free space at {path}"
    else:
        limit, name = None, "none known (object store without extract.quota_bytes)"
    fits = limit is None or total <= limit
    summary = (f"at most {human_bytes(total)} ({tokens:,} tokens × {per_token:,} B/token, {ex.storage_dtype}, "
               f"hidden size {hidden}); limit: {human_bytes(limit) if limit is not None else name}"
               + ("" if fits else " — does NOT fit: extraction would refuse to start"))  # fmt: skip
    return {"extract_bytes": total, "limit_bytes": limit, "limit": name, "fits": fits, "summary": summary}


def render_plan(plan: dict[str, Any]) -> str:
    p, s = plan["prompts"], plan["shards"]
    lines = [
        f"eaglescale run --dry-run: nothing is started. The plan for {plan['run_root']}"
        + ("" if plan["exists"] else " (a new run folder)"),
        "  stages:  " + ", ".join(f"{st} ({plan['done'][st]})" for st in plan["stages"]),
        f"  prompts: {p['count'] if p['count'] is not None else '?'} × {p['samples_per_prompt']} "
        f"sample(s) ({p['basis']})",
        f"  shards:  {s['planned'] if s['planned'] is not None else '?'} of {s['shard_size']} prompts, "
        f"{s['committed']} committed, up to {s['max_parallel']} at once per worker",
        "  servers: generation " + ", ".join(plan["servers"]["generation"])
        + (f" ({plan['servers']['kind']}, {plan['servers']['in_flight_per_server']} in flight each)"
           if "kind" in plan["servers"] else "")
        + f"; gate engine {plan['servers']['gate']}",
        f"  disk:    extraction {plan['disk']['summary']}",
        f"  gate:    {plan['gate']['summary']}",
    ]  # fmt: skip
    if "synthesis" in plan:
        syn = plan["synthesis"]
        lines.insert(2, f"  synthesis: {syn['requests']} prompts the target writes first ("
                     + ", ".join(f"{n} {c}" for n, c in syn["sources"].items())
                     + f"), {syn['committed_shards']} shard(s) committed; then filtered by discovery")
    return "\n".join(lines)
