"""Data-scaling curve: acceptance length against training samples, per domain, with a trend.

The drafts come from the train stage (tasks/draft/scaling_drafts.py: the same training on
fractions of the training split, plus the full draft). Each point is either measured (the
server's accept length on the gate's held-out prompts) or predicted (offline replay of the
held-out extracted sequences); both kinds are plotted, and the trend is fitted to the measured
points when there are any. The trend is least squares of acceptance length on ln(samples); the
projection inverts it at the break-even acceptance length (cost_model).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.runfolder import RunFolder

SCALING_ROOT = "gate/scaling"
_FLAT = 1e-9  # slope (accept length per e-fold of samples) below which a trend is flat
_MAX_EXP = math.log(1e300)
OVERALL = "all"


MEASURED, REPLAY = "measured", "replay"


@dataclass(frozen=True)
class ScalingPoint:
    domain: str
    samples: int  # training sequences
    accept_length: float
    kind: str = REPLAY  # measured (on a server) | replay (offline prediction)


@dataclass
class ScalingFit:
    domain: str
    intercept: float  # accept length at 1 sample (ln 1 = 0)
    slope: float  # accept length per e-fold of samples
    points: int

    def at(self, samples: float) -> float:
        return self.intercept + self.slope * math.log(samples)

    def samples_for(self, accept_length: float) -> float | None:
        """Samples the trend needs to reach `accept_length`; None when it never does (flat or
        falling, up to fitting noise) or only past 1e300 samples. Points already above it give
        a number below the smallest measured."""
        if self.slope <= _FLAT:
            return None
        exponent = (accept_length - self.intercept) / self.slope
        return math.exp(exponent) if exponent < _MAX_EXP else None


def replay_points(samples: int, overall: dict[Any, Any], per_domain: dict[str, dict[Any, Any]],
                  num_steps: Any) -> list[ScalingPoint]:
    """One draft's replayed points at `num_steps` (its key in the replay's tables: an int in a
    ReplayResult, a string once read back from JSON), overall and per domain."""
    tables = {OVERALL: overall, **per_domain}
    return [ScalingPoint(d, samples, t[num_steps]["accept_length"], REPLAY) for d, t in tables.items()
            if (t.get(num_steps) or {}).get("accept_length") is not None]  # fmt: skip


def fit_trend(points: Sequence[ScalingPoint]) -> dict[str, ScalingFit]:
    """Least squares accept = a + b ln(samples), per domain, on its measured points when it has
    any (else its replayed ones); needs two distinct sample counts."""
    out = {}
    for domain in sorted({p.domain for p in points}):
        mine = [p for p in points if p.domain == domain]
        if any(p.kind == MEASURED for p in mine):
            mine = [p for p in mine if p.kind == MEASURED]
        bad = [p for p in mine if p.samples < 1 or not math.isfinite(p.accept_length)]
        if bad:
            raise ValueError(f"domain {domain!r}: points need samples >= 1 and a finite accept length, got {bad[0]}")
        x = np.log([p.samples for p in mine]).astype(np.float64)
        if len(set(x.tolist())) < 2:
            raise ValueError(f"domain {domain!r}: a trend needs points at two or more sample counts")
        y = np.array([p.accept_length for p in mine], dtype=np.float64)
        slope, intercept = np.polyfit(x, y, 1)
        out[domain] = ScalingFit(domain, float(intercept), float(slope), len(mine))
    return out


def projection(fits: dict[str, ScalingFit], break_even: float) -> dict[str, Any]:
    return {
        d: {"intercept": f.intercept, "slope_per_ln_sample": f.slope, "points": f.points,
            "samples_for_break_even": f.samples_for(break_even)}
        for d, f in fits.items()
    }  # fmt: skip


def plot_scaling(points: Sequence[ScalingPoint], fits: dict[str, ScalingFit], break_even: float | None,
                 goal: tuple[str, float] | None = None) -> bytes:
    """PNG: points and fitted trend per domain on a log x axis, the break-even line, and where
    each trend crosses it; `goal` (its label and accept length) a line of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs_all = [p.samples for p in points]
    for i, (domain, fit) in enumerate(sorted(fits.items())):
        color = f"C{i % 10}"
        measured = [p for p in points if p.domain == domain and p.kind == MEASURED]
        replayed = [p for p in points if p.domain == domain and p.kind == REPLAY]
        if measured:
            ax.scatter([p.samples for p in measured], [p.accept_length for p in measured], color=color,
                       label=f"{domain} (measured)")  # fmt: skip
        if replayed:
            ax.scatter([p.samples for p in replayed], [p.accept_length for p in replayed], facecolors="none",
                       edgecolors=color, label=f"{domain} (replay)")  # fmt: skip
        hi = max(xs_all)
        crossing = fit.samples_for(break_even) if break_even is not None else None
        if crossing is not None and math.isfinite(crossing):
            hi = max(hi, min(crossing, 1e3 * max(xs_all)))
        grid = np.geomspace(min(xs_all), hi, 50)
        ax.plot(grid, [fit.at(g) for g in grid], color=color, linestyle="--")
        if crossing is not None and crossing <= hi:
            ax.scatter([crossing], [break_even], marker="x", s=80, color=color)
    if break_even is not None:
        ax.axhline(break_even, color="tab:gray", linestyle=":", label=f"break-even {break_even:.2f}")
    if goal is not None:
        ax.axhline(goal[1], color="tab:green", linestyle="-.", label=goal[0])
    ax.set_xscale("log")
    ax.set_xlabel("training samples (sequences)")
    ax.set_ylabel("acceptance length (tokens per verify)")
    ax.set_title("Acceptance vs training data (x: projected break-even)")
    ax.legend(loc="best", fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def fittable(points: Sequence[ScalingPoint]) -> tuple[list[ScalingPoint], dict[str, str]]:
    """The points of the domains a trend can be fitted to (fit_trend's choice of kind: two or
    more sample counts), and why each other domain has no trend."""
    keep, skipped = [], {}
    for domain in sorted({p.domain for p in points}):
        mine = [p for p in points if p.domain == domain]
        measured = [p for p in mine if p.kind == MEASURED]
        if measured and len({p.samples for p in measured}) < 2:
            mine = [p for p in mine if p.kind == REPLAY]  # too few measured: fall back to replay
        if len({p.samples for p in mine}) < 2:
            skipped[domain] = "fewer than two sample counts measured or replayed"
            continue
        keep += mine
    return keep, skipped


def scaling_report(points: Sequence[ScalingPoint], break_even: float | None, num_steps: int) -> dict[str, Any]:
    """The curve's report: its points, the trend fitted per domain (with the samples it needs
    for `break_even`, when there is one), and why a domain with too few points has no fit."""
    usable, skipped = fittable(points)
    fits = fit_trend(usable) if usable else {}
    return {
        "num_steps": num_steps,
        "break_even_accept_length": break_even,
        "points": [vars(p) for p in points],
        "fits": projection(fits, break_even) if break_even is not None else projection(fits, math.inf),
        "no_fit": skipped,
    }


def curve_png(points: Sequence[ScalingPoint], break_even: float | None, goal: tuple[str, float] | None = None) -> bytes:
    """The curve's plot: the points each trend is fitted on (all of them when no domain has a
    trend), the trends, the break-even and `goal` (plot_scaling's)."""
    usable, _ = fittable(points)
    return plot_scaling(usable or list(points), fit_trend(usable) if usable else {}, break_even, goal)


def write_scaling_report(
    run: RunFolder, points: Sequence[ScalingPoint], break_even: float | None, num_steps: int,
    pre_registered: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """gate/scaling/report.json and gate/scaling/curve.png; returns the report. `pre_registered`:
    the full draft's forecast beside its measurements (tasks/draft/forecast.py's forecast_beside)."""
    report = scaling_report(points, break_even, num_steps)
    if pre_registered is not None:
        report["pre_registered"] = pre_registered
    run.write_json_atomic(f"{SCALING_ROOT}/report.json", report)
    run.write_bytes_atomic(f"{SCALING_ROOT}/curve.png", curve_png(points, break_even))
    return report
