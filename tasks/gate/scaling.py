"""Data-scaling curve: acceptance length against training samples, per domain, with a trend.

Points come from training the draft on fractions of a run's training split (`train_at_fractions`,
each fraction in its own train folder so none resumes another) and replaying the held-out split,
or from measurements made elsewhere. The trend is least squares of acceptance length on
ln(samples); the projection inverts it at the break-even acceptance length (cost_model).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.runfolder import RunFolder

if TYPE_CHECKING:
    from tasks.config import TrainConfig

SCALING_ROOT = "gate/scaling"
_FLAT = 1e-9  # slope (accept length per e-fold of samples) below which a trend is flat
_MAX_EXP = math.log(1e300)
OVERALL = "all"


@dataclass(frozen=True)
class ScalingPoint:
    domain: str
    samples: int  # training sequences
    accept_length: float


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


def fit_trend(points: Sequence[ScalingPoint]) -> dict[str, ScalingFit]:
    """Least squares accept = a + b ln(samples), per domain; needs two distinct sample counts."""
    out = {}
    for domain in sorted({p.domain for p in points}):
        mine = [p for p in points if p.domain == domain]
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


def plot_scaling(points: Sequence[ScalingPoint], fits: dict[str, ScalingFit], break_even: float | None) -> bytes:
    """PNG: points and fitted trend per domain on a log x axis, the break-even line, and where
    each trend crosses it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs_all = [p.samples for p in points]
    for i, (domain, fit) in enumerate(sorted(fits.items())):
        color = f"C{i % 10}"
        mine = [p for p in points if p.domain == domain]
        ax.scatter([p.samples for p in mine], [p.accept_length for p in mine], color=color, label=domain)
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
    ax.set_xscale("log")
    ax.set_xlabel("training samples (sequences)")
    ax.set_ylabel("acceptance length (tokens per verify)")
    ax.set_title("Acceptance vs training data (x: projected break-even)")
    ax.legend(loc="best", fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def write_scaling_report(
    run: RunFolder, points: Sequence[ScalingPoint], break_even: float | None, num_steps: int
) -> dict[str, Any]:
    """gate/scaling/report.json and gate/scaling/curve.png; returns the report."""
    fits = fit_trend(points)
    report = {
        "num_steps": num_steps,
        "break_even_accept_length": break_even,
        "points": [vars(p) for p in points],
        "fits": projection(fits, break_even) if break_even is not None else projection(fits, math.inf),
    }
    run.write_json_atomic(f"{SCALING_ROOT}/report.json", report)
    run.write_bytes_atomic(f"{SCALING_ROOT}/curve.png", plot_scaling(points, fits, break_even))
    return report


class TrainElsewhere(RunFolder):
    """The run with its train/ keys under another prefix: each fraction trains in a folder of
    its own (never resuming another fraction's checkpoints) on the same extract data. Every
    RunFolder method resolves keys through path(), so this one override redirects them all."""

    def __init__(self, run: RunFolder, prefix: str) -> None:
        self.__dict__.update(vars(run))
        self.prefix = prefix.strip("/")

    def path(self, rel: str) -> str:
        rel = rel.strip("/")
        if rel == "train" or rel.startswith("train/"):
            rel = f"{self.prefix}/{rel}"
        return super().path(rel)


def train_at_fractions(
    run: RunFolder,
    cfg: TrainConfig,
    target_model_path: str,
    fractions: Sequence[float] = (0.1, 0.3, 1.0),
    num_steps: int = 3,
    **train_kwargs: Any,
) -> list[ScalingPoint]:
    """Train at each fraction of the training split, replay the held-out split with the best
    checkpoint, and return one point per domain plus the overall one (domain "all")."""
    from tasks.draft import checkpoint as ckpt
    from tasks.draft.target_heads import load_target_heads
    from tasks.draft.trainer import train_draft
    from tasks.extract.storage import extract_metadata
    from tasks.gate.replay import replay_run

    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"fractions must lie in (0, 1], got {list(fractions)}")
    n_train = int(extract_metadata(run)["splits"].get("train", 0))
    if n_train == 0:
        raise ValueError(f"{run.url}/extract has no training sequences")
    embed, _ = load_target_heads(target_model_path)
    points = []
    for fraction in sorted(set(fractions)):
        samples = max(1, round(fraction * n_train))
        view = TrainElsewhere(run, f"{SCALING_ROOT}/frac-{samples}")
        result = train_draft(view, cfg, target_model_path, max_train_sequences=samples, **train_kwargs)
        key = (result.best or {}).get("step")
        chosen = ckpt.checkpoint_key(key) if key is not None else result.last_checkpoint
        draft = ckpt.load_checkpoint_model(view.path(chosen), embed.float())
        replayed = replay_run(run, draft, [num_steps])
        points.append(ScalingPoint(OVERALL, samples, replayed.overall[num_steps]["accept_length"]))
        for domain, table in replayed.per_domain.items():
            if table[num_steps]["accept_length"] is not None:
                points.append(ScalingPoint(domain, samples, table[num_steps]["accept_length"]))
    return points
