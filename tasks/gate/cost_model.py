"""Predict speculative tok/s from per-step costs and acceptance lengths (docs/GATE.md, level 1).

With topk=1 and k draft tokens per cycle, one cycle costs a draft rollout of k tokens and a
target verify of k+1 tokens, and yields accept_len(k) tokens (accepted drafts + the bonus):

    spec tok/s(k)     = accept_len(k) / (verify(k+1) + draft(k) + overhead)
    baseline tok/s    = 1 / (baseline_step + overhead)
    break-even(k)     = (verify(k+1) + draft(k) + overhead) / (baseline_step + overhead)

draft(k) is the measured rollout time of k tokens when given (`draft_cycle_s`), else
k * `draft_step_s`. `overhead_s` is host time per decode step outside the timed steps (the
read-back of the tokens, bookkeeping), taken equal for a baseline step and a cycle;
`calibrate_overhead` derives it from a measured baseline run.

Costs dict format (what `StepCosts.from_dict` reads; SpecEngine.measure_step_costs writes it):

    {"baseline_step_s": 0.0021,                       # one 1-token decode step
     "verify_s": {"2": 0.0023, "4": 0.0025},          # keyed by tokens verified (k+1)
     "draft_cycle_s": {"1": 0.0004, "3": 0.0011},     # optional, keyed by num_steps k
     "draft_step_s": 0.0004,                          # optional: one draft step
     "overhead_s": 0.00005,                           # optional, default 0
     "source": "local_spec" | "sglang" | ...}         # free text, kept in reports

A server benchmark measures whole verify cycles instead (`costs_from_launches`: each launch's
cost probes, tasks/gate/benchmark.py), so its costs carry `cycle_s` keyed by num_steps (draft +
verify + extend, host time included, overhead 0) and `prefill_s`. With `prefill_s` and the
tokens per request a prediction is per request, as the benchmark measures tok/s:

    tok/s(k) = n / (prefill + (n - 1) * cycle(k) / accept_len(k))    (first token from prefill)

Under load a request's replies end at their own lengths, so each end admits another request into
the running batch, whose prefill stalls it: with `admissions` of them in a request's life (the level
less one, requests in flight staying level, at the share that come alone: tasks/gate/load.py's
admission_share) at `admit_s[k]` each (the admission probe's, tasks/gate/benchmark.py), the
denominator gains admissions * admit_s[k].

An SGLang run's step times may also come as records (`costs_from_step_records`):
    {"kind": "baseline" | "verify" | "draft", "tokens": int, "step_time_s": float}
where tokens is 1 for baseline, the tokens verified (k+1) for verify, and the draft tokens
rolled out (k) for draft; each (kind, tokens) group's median is taken.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tasks.sglang.command import SpecParams


class CostModelError(ValueError):
    """Costs or acceptance lengths that cannot give a prediction; says which entry is wrong."""


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise CostModelError(f"{where} must be a positive number of seconds, got {value!r}")
    return float(value)


def _keyed(table: Any, where: str) -> dict[int, float]:
    if not isinstance(table, dict):
        raise CostModelError(f"{where} must be a mapping of integer keys to seconds, got {table!r}")
    out = {}
    for key, value in table.items():
        try:
            k = int(key)
        except (TypeError, ValueError):
            raise CostModelError(f"{where}: key {key!r} is not an integer") from None
        out[k] = _positive(value, f"{where}[{key!r}]")
    return out


@dataclass
class StepCosts:
    baseline_step_s: float
    verify_s: dict[int, float]  # tokens verified (k+1) -> seconds
    draft_cycle_s: dict[int, float] = field(default_factory=dict)  # num_steps k -> seconds
    draft_step_s: float | None = None
    overhead_s: float = 0.0
    source: str = ""
    cycle_s: dict[int, float] = field(default_factory=dict)  # num_steps k -> a whole cycle, timed
    prefill_s: float | None = None
    # num_steps k (0: the baseline) -> what admitting one request into a running batch costs the
    # requests already in it (its prefill stalls their steps): the admission probe's.
    admit_s: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepCosts:
        known = {"baseline_step_s", "verify_s", "draft_cycle_s", "draft_step_s", "overhead_s",
                 "source", "cuda_graphs", "device", "cycle_s", "prefill_s", "admit_s"}  # fmt: skip
        unknown = sorted(set(d) - known)
        if unknown:
            raise CostModelError(f"step costs: unknown keys {unknown} (known: {sorted(known)})")
        if "baseline_step_s" not in d:
            raise CostModelError("step costs: baseline_step_s is missing")
        if "verify_s" not in d and "cycle_s" not in d:
            raise CostModelError("step costs: verify_s (or a measured cycle_s) is missing")
        prefill = d.get("prefill_s")
        overhead = d.get("overhead_s", 0.0)
        if isinstance(overhead, bool) or not isinstance(overhead, int | float) or overhead < 0:
            raise CostModelError(f"step costs: overhead_s must be >= 0 seconds, got {overhead!r}")
        draft_step = d.get("draft_step_s")
        return cls(
            baseline_step_s=_positive(d["baseline_step_s"], "step costs: baseline_step_s"),
            verify_s=_keyed(d.get("verify_s", {}), "step costs: verify_s"),
            draft_cycle_s=_keyed(d.get("draft_cycle_s", {}), "step costs: draft_cycle_s"),
            draft_step_s=None if draft_step is None else _positive(draft_step, "step costs: draft_step_s"),
            overhead_s=float(overhead),
            source=str(d.get("source", "")),
            cycle_s=_keyed(d.get("cycle_s", {}), "step costs: cycle_s"),
            prefill_s=None if prefill is None else _positive(prefill, "step costs: prefill_s"),
            admit_s={int(k): float(v) for k, v in d.get("admit_s", {}).items()},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline_step_s": self.baseline_step_s,
            "verify_s": {str(k): v for k, v in sorted(self.verify_s.items())},
            "draft_cycle_s": {str(k): v for k, v in sorted(self.draft_cycle_s.items())},
            "draft_step_s": self.draft_step_s,
            "overhead_s": self.overhead_s,
            "source": self.source,
            "cycle_s": {str(k): v for k, v in sorted(self.cycle_s.items())},
            "prefill_s": self.prefill_s,
            "admit_s": {str(k): v for k, v in sorted(self.admit_s.items())},
        }

    def draft_cost(self, k: int) -> float:
        if k in self.draft_cycle_s:
            return self.draft_cycle_s[k]
        if self.draft_step_s is not None:
            return k * self.draft_step_s
        raise CostModelError(
            f"no draft cost for num_steps {k}: draft_cycle_s has {sorted(self.draft_cycle_s)} "
            "and draft_step_s is not set"
        )

    def verify_cost(self, k: int) -> float:
        if k + 1 not in self.verify_s:
            raise CostModelError(
                f"no verify cost for num_steps {k}: verify_s lacks {k + 1} tokens "
                f"(has {sorted(self.verify_s)})"
            )
        return self.verify_s[k + 1]

    def covers(self, k: int) -> bool:
        """Whether a cycle of num_steps k has a cost here."""
        return k in self.cycle_s or (k + 1 in self.verify_s and (k in self.draft_cycle_s or self.draft_step_s is not None))

    def cycle_cost(self, k: int) -> float:
        if k in self.cycle_s:
            return self.cycle_s[k] + self.overhead_s
        return self.verify_cost(k) + self.draft_cost(k) + self.overhead_s

    def baseline_cost(self) -> float:
        return self.baseline_step_s + self.overhead_s


def calibrate_overhead(costs: StepCosts, measured_baseline_tok_s: float) -> StepCosts:
    """A copy whose overhead_s = measured seconds per baseline token - the timed step alone."""
    per_token = 1.0 / _positive(measured_baseline_tok_s, "measured_baseline_tok_s")
    return StepCosts(
        costs.baseline_step_s, dict(costs.verify_s), dict(costs.draft_cycle_s), costs.draft_step_s,
        max(0.0, per_token - costs.baseline_step_s), costs.source, dict(costs.cycle_s), costs.prefill_s,
    )  # fmt: skip


def costs_from_step_records(records: list[dict[str, Any]], source: str = "sglang") -> StepCosts:
    """Median step time per (kind, tokens) from an SGLang run's step-time records."""
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for i, r in enumerate(records):
        kind, tokens = r.get("kind"), r.get("tokens")
        if kind not in ("baseline", "verify", "draft"):
            raise CostModelError(f"step record {i}: kind must be baseline, verify or draft, got {kind!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise CostModelError(f"step record {i}: tokens must be an integer >= 1, got {tokens!r}")
        groups[(kind, tokens)].append(_positive(r.get("step_time_s"), f"step record {i}: step_time_s"))
    base = [v for (kind, _), vs in groups.items() if kind == "baseline" for v in vs]
    if not base:
        raise CostModelError("step records: no baseline records, so no baseline step cost")
    return StepCosts(
        baseline_step_s=statistics.median(base),
        verify_s={t: statistics.median(v) for (kind, t), v in groups.items() if kind == "verify"},
        draft_cycle_s={t: statistics.median(v) for (kind, t), v in groups.items() if kind == "draft"},
        source=source,
    )


@dataclass
class Prediction:
    baseline_tok_s: float
    per_steps: dict[int, dict[str, float]]  # k -> accept_length, cycle_s, tok_s, speedup, break_even
    best_num_steps: int | None  # highest predicted tok/s; None when no k beats the baseline

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline_tok_s": self.baseline_tok_s,
            "per_steps": {str(k): v for k, v in sorted(self.per_steps.items())},
            "best_num_steps": self.best_num_steps,
        }

    def gate_predictions(self, algorithm: str = "EAGLE3") -> dict[str, float]:
        """tok/s keyed by the gate's config names (tasks.gate.plan: "baseline" and SpecParams
        labels at topk=1), for write_gate_report's `predictions`."""
        out = {"baseline": self.baseline_tok_s}
        for k, row in self.per_steps.items():
            out[SpecParams("", k, 1, k + 1, algorithm).label] = row["tok_s"]
        return out


def queued_step(level_costs: dict[str, Any], level: int, cap: int | None) -> float:
    """A request's step cost at `level` in flight, from a launch's level probes (level -> step_s):
    the probe's own below the server's running-request cap. Above it a probe batch of C requests
    runs in turns, m = C // cap of `cap` requests and one of the rest r, so its step is the sum of
    the turns' (m * step(cap) + step(r)); under a steady load each request holds a slot cap / C
    of the time, so its step is step(cap) * C / cap. step(r) is read from the probes at the levels
    around r (linear between them; the lowest one's below it)."""
    probed = level_costs[str(level)]["step_s"]
    if cap is None or level <= cap:
        return probed
    turns, rest = divmod(level, cap)
    known = sorted((int(k), v["step_s"]) for k, v in level_costs.items() if v.get("step_s") is not None)
    rest_step = float(np.interp(rest, [lv for lv, _ in known], [st for _, st in known])) if rest else 0.0
    full = (probed - rest_step) / turns
    return max(full, probed / (turns + 1)) * level / cap  # a turn never costs less than an even share


def costs_from_launches(result: Any, source: str = "sglang", level: int | None = None) -> StepCosts:
    """Step costs from a server benchmark's cost probes (a BenchResult's LaunchRecord.prefill_s
    and step_s, or at a load level its level_costs, with its admission probe's admit_s): the
    median over the baseline launches, and over each topk=1 num_steps of the candidate draft's
    launches (reference, scaling and policy launches are left out)."""
    configs = {c.name: c for c in result.configs}
    base, prefill, cycles, admits = [], [], defaultdict(list), defaultdict(list)
    for x in result.launches:
        config = configs[x.config]
        if config.role != "candidate":
            continue
        probe = x.level_costs.get(str(level), {}) if level is not None else {"prefill_s": x.prefill_s, "step_s": x.step_s}
        if probe.get("prefill_s") is not None:
            prefill.append(probe["prefill_s"])
        if config.spec is not None and config.spec.topk != 1:
            continue
        k = config.spec.num_steps if config.spec is not None else 0
        if probe.get("admit_s") is not None:
            admits[k].append(probe["admit_s"])
        if probe.get("step_s") is None:
            continue
        step = probe["step_s"] if level is None else queued_step(x.level_costs, level, x.max_running_requests)
        (base if k == 0 else cycles[k]).append(step)
    if not base:
        raise CostModelError("no baseline launch measured a step cost" + (f" at concurrency {level}" if level else ""))
    return StepCosts(
        baseline_step_s=statistics.median(base), verify_s={},
        cycle_s={k: statistics.median(v) for k, v in sorted(cycles.items())},
        prefill_s=statistics.median(prefill) if prefill else None, source=source,
        admit_s={k: statistics.median(v) for k, v in sorted(admits.items())},
    )  # fmt: skip


def predict(
    costs: StepCosts | dict[str, Any], accept_lengths: dict[int, float], tokens_per_request: float | None = None,
    admissions: float = 0.0,
) -> Prediction:
    """Predicted tok/s, speedup and break-even acceptance length for each num_steps; per request
    (prefill included) when the costs have `prefill_s` and `tokens_per_request` is given, with
    `admissions` other requests admitted into its batch while it runs, each at admit_s."""
    if isinstance(costs, dict):
        costs = StepCosts.from_dict(costs)
    if not accept_lengths:
        raise CostModelError("no acceptance lengths to predict from")
    n, prefill = tokens_per_request, costs.prefill_s
    per_request = n is not None and n > 1 and prefill is not None

    def rate(step: float, tokens_per_step: float, k: int) -> float:
        if per_request:
            stalls = admissions * costs.admit_s.get(k, 0.0)
            return n / (prefill + (n - 1) * step / tokens_per_step + stalls)  # type: ignore[operator]
        return tokens_per_step / step

    baseline = rate(costs.baseline_cost(), 1.0, 0)
    rows: dict[int, dict[str, float]] = {}
    for k, length in sorted(accept_lengths.items()):
        if not isinstance(k, int) or k < 1:
            raise CostModelError(f"acceptance lengths: num_steps {k!r} must be an integer >= 1")
        if not 1.0 <= length <= k + 1:
            raise CostModelError(
                f"acceptance length {length!r} for num_steps {k} is outside [1, {k + 1}] (tokens per verify)"
            )
        cycle = costs.cycle_cost(k)
        tok_s = rate(cycle, length, k)
        rows[k] = {
            "accept_length": float(length),
            "cycle_s": cycle,
            "tok_s": tok_s,
            "speedup": tok_s / baseline,
            "break_even_accept_length": cycle / costs.baseline_cost(),
        }
    best = max(rows, key=lambda k: rows[k]["tok_s"])
    return Prediction(baseline, rows, best if rows[best]["speedup"] > 1.0 else None)
