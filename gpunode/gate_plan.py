"""The gate's launch plan for a session, from the product: the GateConfig the gate stage loads
(tasks/config's load_config: the profile and the stage's --set overrides) and the device time of
its launches (tasks/gate/plan.py's forecast_launches, at the profile's gate.forecast_launch_s and
gate.forecast_tok_s: what `eaglescale run --dry-run` prints), for the whole gate and for each
smaller one a session may run instead (gate_trims: the session's policy of what to leave out).

Runs as a helper process (`python3 -m gpunode node gate-plan PROFILE --set ...`): the pipeline
process has no pydantic. It prints one JSON line; gate_session.py reads it."""

from __future__ import annotations

import json
from typing import Any

from tasks.config import load_config
from tasks.config.gate_section import GateConfig
from tasks.gate.plan import CHALLENGER, SCALING, ExtraDraft, forecast_launches


def gate_trims(gate: GateConfig) -> list[tuple[list[str], GateConfig]]:
    """The gates a session may run for its device time, the whole first, each smaller than the
    one before, with its --set overrides: the chains left out one at a time, the farthest from the
    kept one first and the shorter of two as far (num_steps 1 ran at 0.77x the baseline where 2
    and 3 ran level: BENCHMARKS P18), then the topk points. The baseline and the kept chain always
    stay: the least gate that decides. The kept chain is gate.scaling_num_steps when the gate
    measures it (where the accept-length goal and the data-scaling curve are read), else the
    longest."""
    steps = sorted(gate.num_steps)
    kept = gate.scaling_num_steps if gate.scaling_num_steps in steps else (steps[-1] if steps else gate.scaling_num_steps)
    dropped = sorted((k for k in steps if k != kept), key=lambda k: (-abs(k - kept), k))
    out: list[tuple[list[str], GateConfig]] = [([], gate)]
    for i in range(1, len(dropped) + 1):
        left = [k for k in steps if k not in dropped[:i]]
        out.append(([f"gate.num_steps={left}"], gate.model_copy(update={"num_steps": left})))
    if gate.topk_points and steps:  # a gate of topk points alone keeps them
        sets, last = out[-1]
        out.append(([*sets, "gate.topk_points=[]"], last.model_copy(update={"topk_points": []})))
    return out


def preferred(trims: list[tuple[list[str], GateConfig]]) -> int:
    """The least gate that still measures the topk points (the tree: on SmolLM2 it accepted 2.12
    tokens a verify where the 3-step chain accepted 1.72, and ran 10% faster, BENCHMARKS P8): what
    a session that trains its draft plans the draft's epochs around. An index into `trims`."""
    return next((i for i in range(len(trims) - 1, -1, -1) if trims[i][1].topk_points), len(trims) - 1)


def _extra(gate: GateConfig, scaling_drafts: int) -> list[ExtraDraft]:
    """The drafts measured beside the run's, as `eaglescale run --dry-run` counts them: the
    challengers, and `scaling_drafts` data-scaling drafts (once each)."""
    extra = [ExtraDraft(c.name, c.path, c.num_steps, c.topk, c.num_draft_tokens, CHALLENGER) for c in gate.challengers]
    return extra + [ExtraDraft(f"scaling-{i}", "DRAFT", gate.scaling_num_steps, role=SCALING) for i in range(scaling_drafts)]


def _row(sets: list[str], gate: GateConfig, scaling_drafts: int) -> dict[str, Any]:
    forecast = forecast_launches(gate, extra=_extra(gate, scaling_drafts))
    return {"sets": sets, "num_steps": list(gate.num_steps), "topk_points": [p.model_dump() for p in gate.topk_points],
            "launches": forecast.launches, "device_s": forecast.device_s}  # fmt: skip


def gate_plan(profile: str, sets: list[str], scaling_drafts: int = 0) -> dict[str, Any]:
    """The gate the stage would run with `sets` (every trim of it, each with its forecast), the
    one gate_trims' policy prefers, and the whole gate at one repetition (a data-scaling curve's
    points need one launch each)."""
    gate = load_config(profile, sets).gate
    trims = gate_trims(gate)
    return {"trims": [_row(s, g, scaling_drafts) for s, g in trims], "preferred": preferred(trims),
            "one_repetition": _row(["gate.repetitions=1"], gate.model_copy(update={"repetitions": 1}), scaling_drafts),
            "forecast_launch_s": gate.forecast_launch_s, "forecast_tok_s": gate.forecast_tok_s}  # fmt: skip


def node_gate_plan(profile: str, sets: list[str], scaling_drafts: int) -> int:
    print(json.dumps(gate_plan(profile, sets, scaling_drafts)))
    return 0
