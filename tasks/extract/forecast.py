"""Disk forecast for extraction, made before any work: bytes/token × projected tokens.

Projected tokens come from the committed generation markers: Σ(prompt_tokens +
completion_tokens) plus the turn terminator each sequence may gain, capped at
rows × max_length (an upper bound: the per-sequence cap needs the rows themselves, which the
markers do not hold). While generation is still running, the committed shards' mean is
extrapolated to every planned shard. The budget is extract.quota_bytes when set, else the
free space of a local destination; an object store without a quota has no known limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.errors import ExpectedFailure
from tasks.extract.sizes import bytes_per_token, free_bytes_at, human_bytes
from tasks.extract.storage import STAGE
from tasks.runfolder import RunFolder, ShardStore
from tasks.runfolder.layout import SHARD_PLAN


class DiskForecastError(RuntimeError, ExpectedFailure):
    """The extracted data would not fit its destination; the message gives both sizes."""


def projected_tokens(
    run: RunFolder, max_length: int, extra_per_sequence: int = 1
) -> dict[str, Any]:
    """Tokens the extraction will store, from the generation markers committed so far."""
    gen = ShardStore(run, "generate")
    markers = gen.committed()
    rows = sum(m["rows"] for m in markers.values())
    raw = sum(m.get("prompt_tokens", 0) + m.get("completion_tokens", 0) for m in markers.values())
    committed = min(raw + rows * extra_per_sequence, rows * max_length)
    plan = run.read_json(SHARD_PLAN) or {}
    planned_shards = len(plan.get("shards", [])) or len(markers)
    complete = gen.is_complete()
    if complete or not markers or planned_shards <= len(markers):
        projected, basis = committed, "committed generation shards"
    else:
        projected = round(committed / len(markers) * planned_shards)
        basis = f"mean of {len(markers)} committed shards × {planned_shards} planned"
    return {
        "sequences": rows,
        "committed_tokens": committed,
        "projected_tokens": projected,
        "generation_complete": complete,
        "basis": basis,
    }


def _local_free_bytes(run: RunFolder) -> int | None:
    return free_bytes_at(Path(run.path(STAGE)))[0] if run.is_local else None


def forecast_extract(
    run: RunFolder,
    hidden_size: int,
    storage_dtype: str,
    max_length: int,
    quota_bytes: int | None = None,
    extra_per_sequence: int = 1,
) -> dict[str, Any]:
    """The forecast the UI shows; `fits` False means the stage must not start."""
    per_token = bytes_per_token(hidden_size, storage_dtype)
    tokens = projected_tokens(run, max_length, extra_per_sequence)
    # seq_offsets: 8 bytes a sequence; headers and metadata are noise next to the states.
    sequences = tokens["sequences"] or 0
    total = tokens["projected_tokens"] * per_token + 8 * sequences
    written = sum(m.get("bytes", 0) for m in ShardStore(run, STAGE).committed().values())
    remaining = max(0, total - written)
    free = _local_free_bytes(run)
    if quota_bytes is not None:
        limit, limit_name, needed = quota_bytes, "the quota (extract.quota_bytes)", total
    elif free is not None:
        limit, limit_name, needed = free, f"the free space at {run.url}", remaining
    else:
        limit, limit_name, needed = (
            None,
            "unknown (object store without extract.quota_bytes)",
            remaining,
        )
    return {
        "storage_dtype": storage_dtype,
        "hidden_size": hidden_size,
        "bytes_per_token": per_token,
        **tokens,
        "total_bytes": total,
        "written_bytes": written,
        "needed_bytes": needed,
        "limit_bytes": limit,
        "limit": limit_name,
        "fits": limit is None or needed <= limit,
        "summary": (
            f"{human_bytes(total)} ({tokens['projected_tokens']:,} tokens × "
            f"{human_bytes(per_token)}/token, {storage_dtype}); limit: "
            + (human_bytes(limit) if limit is not None else "none known")
        ),
    }


def online_forecast(run: RunFolder, max_length: int, extra_per_sequence: int = 1) -> dict[str, Any]:
    """The forecast of a run with `train.hidden_states: online`: the trainer captures the
    states as it trains and nothing is stored, whatever the projected tokens."""
    tokens = projected_tokens(run, max_length, extra_per_sequence)
    return {
        "hidden_states": "online",
        **tokens,
        "total_bytes": 0,
        "needed_bytes": 0,
        "fits": True,
        "summary": (
            f"0 B: online hidden states (train.hidden_states: online); the trainer runs the target "
            f"over its {tokens['projected_tokens']:,} tokens as it trains and stores none, so the "
            "extract stage is skipped"
        ),
    }


def check_forecast(forecast: dict[str, Any]) -> None:
    """Refuse, naming both numbers, when the forecast does not fit."""
    if forecast["fits"]:
        return
    hint = (
        " Use extract.storage_dtype=fp8_e4m3 to halve it, a lower extract.max_length, or a larger "
        "destination."
        if forecast["storage_dtype"] == "bf16"
        else " Use a lower extract.max_length or a larger destination."
    )
    raise DiskForecastError(
        f"extraction needs {human_bytes(forecast['needed_bytes'])} "
        f"({forecast['needed_bytes']:,} bytes: {forecast['projected_tokens']:,} tokens × "
        f"{forecast['bytes_per_token']:,} bytes/token, {forecast['storage_dtype']}, hidden size "
        f"{forecast['hidden_size']}) but {forecast['limit']} is "
        f"{human_bytes(forecast['limit_bytes'])} ({forecast['limit_bytes']:,} bytes).{hint}"
    )
