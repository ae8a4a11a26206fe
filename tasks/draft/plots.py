"""PNG of the held-out per-position accuracy (and simulated acceptance) over training."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: workers have no display

import matplotlib.pyplot as plt  # noqa: E402


def accuracy_plot_png(evals: Sequence[dict[str, Any]], title: str = "EAGLE-3 draft, held-out") -> bytes:
    """acc_0..acc_k per eval step on the left axis, sim_accept_len on the right."""
    if not evals:
        raise ValueError("no evaluations to plot")
    steps = [e["step"] for e in evals]
    positions = sorted(
        int(k.split("_")[1]) for k in evals[-1] if k.startswith("acc_") and k[4:].isdigit()
    )
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        cmap = plt.get_cmap("viridis", max(2, len(positions)))
        for i, k in enumerate(positions):
            ax.plot(steps, [e.get(f"acc_{k}", float("nan")) for e in evals], marker=".",
                    color=cmap(i), label=f"acc_{k}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("accuracy (full target vocab)")
        ax.set_ylim(0.0, 1.0)
        ax.grid(alpha=0.3)
        right = ax.twinx()
        right.plot(steps, [e.get("sim_accept_len", float("nan")) for e in evals], color="black",
                   linestyle="--", label="sim accept len (+1 bonus)")
        right.set_ylabel("simulated acceptance length")
        lines = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=7, ncol=2)
        ax.set_title(title)
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)
