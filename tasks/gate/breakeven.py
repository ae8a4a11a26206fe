"""Break-even measured on the server itself, not extrapolated.

The cost model (tasks/gate/cost_model.py) predicts the accept length at which a draft breaks even
from one cycle cost, timed by the cost probes at the draft's own acceptance and taken as constant
in the accept length: break-even(k) = cycle(k) / baseline step. On the H200 a cycle's cost moves
with the tokens it accepts (SmolLM2 shape, 3 steps: 2.65 ms per cycle at ~1 token per verify with
a random draft, 3.6 ms at a forced 3.0), and the one timed cycle does not say which way: with the
trained SmolLM2 draft the model put break-even at 3.33 (3 steps) and 2.62 (5 steps) where the
server measured 2.91 and 2.51 (BENCHMARKS.md P9). Hence this measurement beside it.

With gate.breakeven_accept_lengths the gate launches each topk=1 config of the sweep once per
accept length X with SGLANG_SIMULATE_ACC_LEN=X (the real draft and verify pipeline, acceptance
forced: tasks/sglang/simulated_acceptance.py; role "breakeven", never promoted, its filler output
never compared) on the first gate.breakeven_prompts prompts, each run to max_new_tokens. Its
decode tok/s at the accept length it reached, against the baseline's decode tok/s on the same
prompts, traces the server's own curve; linear interpolation between the measured points where
they cross the baseline gives the break-even accept length. When no measured pair brackets the
crossing the report says on which side it lies. The cost model's prediction is set beside it.

Decode tok/s: tokens after the first over the time after the first, (completion - 1) / (latency
- the launch's time to the first token, timed by its cost probes). It is what a cycle cost speaks
to, and it leaves out the prefill share that makes a short request look slow (the filler runs to
max_new_tokens, the baseline stops where it stops).
"""

from __future__ import annotations

import statistics
from typing import Any

from tasks.gate.cost_model import CostModelError, costs_from_launches
from tasks.gate.plan import BREAKEVEN, BenchConfig
from tasks.gate.records import BenchResult, LaunchRecord, pooled_accept_lengths


def decode_tok_s(launch: LaunchRecord, prompts: int) -> list[float]:
    """Decode tok/s of a launch's successful requests on the first `prompts` prompts."""
    if launch.prefill_s is None:
        return []
    return [(r.completion_tokens - 1) / (r.latency_s - launch.prefill_s) for r in launch.requests
            if r.error is None and r.prompt_index < prompts and r.completion_tokens > 1 and r.latency_s > launch.prefill_s]  # fmt: skip


def crossing(points: list[tuple[float, float]], level: float) -> tuple[float | None, str | None]:
    """The first x where the piecewise-linear curve through `points` (x, y) reaches `level`, and
    None; or None and the side ("above": every y is below the level, so the crossing lies beyond
    the largest x; "below": every y is above it) when no measured pair brackets it."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if (y0 - level) * (y1 - level) <= 0 and y1 != y0:
            return x0 + (level - y0) * (x1 - x0) / (y1 - y0), None
    if len(pts) == 1 and pts[0][1] == level:
        return pts[0][0], None
    return None, "above" if all(y < level for _, y in pts) else "below"


def _statement(k: int, row: dict[str, Any]) -> str:
    xs = [p["accept_length"] for p in row["points"]]
    if row["break_even"] is not None:
        need = f"this server needs {row['break_even']:.2f} tokens per verify at num_steps {k} to break even"
    elif row["side"] == "above":
        need = (f"this server needs more than {max(xs):.2f} tokens per verify at num_steps {k} to break even "
                "(slower than the baseline at every accept length measured; the range does not bracket it)")  # fmt: skip
    else:
        need = (f"this server needs less than {min(xs):.2f} tokens per verify at num_steps {k} to break even "
                "(faster than the baseline at every accept length measured; the range does not bracket it)")  # fmt: skip
    reached = row["draft_accept_length"]
    draft = f"the draft reached {reached:.2f}" if reached is not None else "the draft was not measured there"
    model = row["model_break_even"]
    return f"{need}; {draft}" + (f"; the cost model predicted {model:.2f}" if model is not None else "")


def measure_breakeven(
    result: BenchResult, draft: dict[int, tuple[str, float | None]], prompts: int
) -> dict[str, Any] | None:
    """The measured break-even per num_steps (see the module docstring), or None without
    break-even launches. `draft`: num_steps -> (config, accept length) of the run's draft as
    measured (its topk=1 configs in the default environment)."""
    configs = {c.name: c for c in result.configs}
    simulated = [c for c in result.configs if c.role == BREAKEVEN and c.spec is not None]
    if not simulated:
        return None
    env = simulated[0].env_name
    base_rates = [v for x in result.launches if configs[x.config].is_baseline and x.env_name == env
                  for v in decode_tok_s(x, prompts)]  # fmt: skip
    try:
        costs = costs_from_launches(result)
    except CostModelError:
        costs = None
    out: dict[str, Any] = {"prompts": prompts, "env": env,
                           "baseline_decode_tok_s": statistics.median(base_rates) if base_rates else None,
                           "baseline_requests": len(base_rates), "per_steps": {}}  # fmt: skip
    if not base_rates:
        out["note"] = "no baseline launch gave a decode rate (no time to first token or no request of 2+ tokens)"
        return out
    by_steps: dict[int, list[BenchConfig]] = {}
    for c in simulated:
        assert c.spec is not None
        by_steps.setdefault(c.spec.num_steps, []).append(c)
    for k, group in sorted(by_steps.items()):
        points = []
        for c in group:
            launches = [x for x in result.launches if x.config == c.name]
            rates = [v for x in launches for v in decode_tok_s(x, prompts)]
            accept, _ = pooled_accept_lengths([r for x in launches for r in x.requests])
            if rates and accept is not None:
                points.append({"config": c.name, "simulated": c.simulated_accept_length, "accept_length": accept,
                               "decode_tok_s": statistics.median(rates), "requests": len(rates)})  # fmt: skip
        config, reached = draft.get(k, (None, None))
        model = costs.cycle_cost(k) / costs.baseline_cost() if costs is not None and costs.covers(k) else None
        row: dict[str, Any] = {"points": points, "break_even": None, "side": None, "model_break_even": model,
                               "model_cycle_s": costs.cycle_cost(k) if model is not None and costs else None,
                               "draft_config": config, "draft_accept_length": reached}  # fmt: skip
        if not points:
            row["statement"] = f"num_steps {k}: no break-even launch gave a measurement"
        else:
            row["break_even"], row["side"] = crossing([(p["accept_length"], p["decode_tok_s"]) for p in points],
                                                      out["baseline_decode_tok_s"])  # fmt: skip
            row["statement"] = _statement(k, row)
        out["per_steps"][str(k)] = row
    if costs is not None:
        out["model_baseline_step_s"] = costs.baseline_cost()
    return out


def breakeven_markdown(breakeven: dict[str, Any] | None) -> list[str]:
    """report.md's section: the statements, then the measured points beside the cost model's."""
    if not breakeven:
        return []
    lines = ["## Break-even on this server (measured)", ""]
    base = breakeven.get("baseline_decode_tok_s")
    if base is None:
        return lines + [f"Not measured: {breakeven.get('note', 'no baseline decode rate')}.", ""]
    lines.append(f"Baseline decode {base:.1f} tok/s over {breakeven['baseline_requests']} requests "
                 f"(the first {breakeven['prompts']} prompts). Acceptance forced by SGLANG_SIMULATE_ACC_LEN; "
                 "decode tok/s = tokens after the first over the time after the first.")  # fmt: skip
    lines.append("")
    lines += [f"- {row['statement']}." for row in breakeven["per_steps"].values()]
    lines += ["", "| num_steps | SGLANG_SIMULATE_ACC_LEN | accept length reached | decode tok/s | x baseline | cost model tok/s |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    step = breakeven.get("model_baseline_step_s")
    for k, row in breakeven["per_steps"].items():
        cycle = row.get("model_cycle_s")
        for p in row["points"]:
            model = f"{p['accept_length'] / cycle:.1f}" if cycle else "-"
            lines.append(f"| {k} | {p['simulated']:g} | {p['accept_length']:.2f} | {p['decode_tok_s']:.1f} | "
                         f"{p['decode_tok_s'] / base:.3f}x | {model} |")  # fmt: skip
    if step:
        lines += ["", f"Cost model: one cycle as timed at the draft's own acceptance, constant in the accept length, "
                      f"against a baseline step of {step * 1e3:.3f} ms (its break-even: cycle / step)."]  # fmt: skip
    return lines + [""]
