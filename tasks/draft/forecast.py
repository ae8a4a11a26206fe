"""The full draft's accept length, forecast from the data-scaling drafts before it trains
(train.forecast_full_draft), and then set beside what it reached.

Each scaling draft's last evaluation gives its pooled accept length on the full draft's held-out
split with k draft positions (training's evaluation, k = 1..ttt_steps). Per k the forecast fits
accept length = intercept + slope * ln(training sequences) to them (the curve's form, BENCHMARKS
P23, P30) and reads it at the full training split. train/forecast.json is written once, before the
full draft's first step; its content hash goes into the full draft's train/result.json, so a reader
sees which came first. train/forecast-check.json sets the full draft's own held-out figures beside
the forecast once it has trained; the gate's server figures come later, in gate/report.json.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from tasks.runfolder import RunFolder, content_hash

FORECAST_KEY = "train/forecast.json"
FORECAST_CHECK_KEY = "train/forecast-check.json"
_POOLED = "pooled_accept_len_"


def held_out_accept_lengths(result: dict[str, Any]) -> dict[int, float]:
    """k -> pooled accept length at the last evaluation of a training's result.json."""
    evals = result.get("evals") or []
    last = evals[-1] if evals else {}
    return {int(key.removeprefix(_POOLED)): float(v) for key, v in last.items() if key.startswith(_POOLED)}


def forecast_reference(forecast: dict[str, Any]) -> dict[str, Any]:
    """What names a written forecast: its content hash and when it was written."""
    return {"content_hash": content_hash(forecast, 16), "written_at": forecast["written_at"]}


def write_forecast(run: RunFolder, drafts: list[dict[str, Any]], train_sequences: int) -> dict[str, Any]:
    """train/forecast.json from the finished scaling drafts (the train stage's index entries);
    returns its reference (forecast_reference). A forecast already written stands."""
    existing = run.read_json(FORECAST_KEY)
    if existing is not None:
        return forecast_reference(existing)
    points = []
    for draft in drafts:
        result = run.read_json(f"{draft['final'].rsplit('/', 1)[0]}/result.json") or {}
        points.append({"samples": int(draft["samples"]), "accept_length": held_out_accept_lengths(result)})
    ks = sorted(set.intersection(*(set(p["accept_length"]) for p in points))) if points else []
    if len(points) < 2 or not ks:
        raise ValueError(f"{run.url}: a forecast needs two or more finished scaling drafts with held-out "
                         f"evaluations; got {len(points)}")  # fmt: skip
    x = np.log([p["samples"] for p in points])
    fits: dict[str, Any] = {}
    for k in ks:
        y = np.array([p["accept_length"][k] for p in points])
        slope, intercept = np.polyfit(x, y, 1)
        residuals = y - (intercept + slope * x)
        fits[str(k)] = {"slope_per_e_fold": float(slope), "intercept": float(intercept),
                        "residual_rms": float(math.sqrt(float(np.mean(residuals**2)))),
                        "forecast": float(intercept + slope * math.log(train_sequences))}  # fmt: skip
    body = {"written_at": time.time(), "train_sequences": int(train_sequences), "points": points, "fits": fits,
            "measure": "training's evaluation on the full draft's held-out split: pooled accept length with k "
                       "draft positions, at each scaling draft's last evaluation"}  # fmt: skip
    run.write_json_atomic(FORECAST_KEY, body)
    return forecast_reference(body)


def check_forecast(run: RunFolder, result: dict[str, Any]) -> dict[str, Any] | None:
    """train/forecast-check.json: per k the forecast beside the full draft's own held-out figure
    (its `result`), and their difference; None without a forecast."""
    forecast = run.read_json(FORECAST_KEY)
    if forecast is None:
        return None
    reached = held_out_accept_lengths(result)
    per_k = {k: {"forecast": fit["forecast"], "reached": reached.get(int(k)),
                 "difference": reached[int(k)] - fit["forecast"] if int(k) in reached else None}
             for k, fit in forecast["fits"].items()}  # fmt: skip
    ref = forecast_reference(forecast)
    check = {"checked_at": time.time(), "forecast_hash": ref["content_hash"], "forecast_written_at": ref["written_at"],
             "train_sequences": forecast["train_sequences"], "per_num_steps": per_k}  # fmt: skip
    run.write_json_atomic(FORECAST_CHECK_KEY, check)
    return check


def forecast_beside(run: RunFolder, k: int, measured: dict[str, float | None]) -> dict[str, Any] | None:
    """The pre-registered forecast at `k` draft positions beside what measured the full draft there
    (`measured`: e.g. the gate's replay and server figures, and training's own from the check),
    each with its difference; None without a forecast."""
    forecast = run.read_json(FORECAST_KEY)
    if forecast is None or str(k) not in forecast["fits"]:
        return None
    value = forecast["fits"][str(k)]["forecast"]
    reached = ((run.read_json(FORECAST_CHECK_KEY) or {}).get("per_num_steps") or {}).get(str(k), {}).get("reached")
    figures = {"training_evaluation": reached, **measured}
    return {"num_steps": k, "forecast": value, **forecast_reference(forecast), "train_sequences": forecast["train_sequences"],
            "measured": {name: {"value": v, "difference": None if v is None else v - value} for name, v in figures.items()}}  # fmt: skip
