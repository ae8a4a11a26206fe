"""PNG of the training curves: held-out per-position accuracy and acceptance lengths, and the
gradient norm and clip rate of the training steps."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: workers have no display

import matplotlib.pyplot as plt  # noqa: E402


def accuracy_plot_png(
    evals: Sequence[dict[str, Any]],
    history: Sequence[dict[str, Any]] = (),
    max_grad_norm: float | None = None,
    title: str = "EAGLE-3 draft, held-out",
) -> bytes:
    """Top: acc_0..acc_k per eval step on the left axis; sim_accept_len and the pooled chain
    accept length (the most drafts per cycle evaluated) on the right. Below, when `history`
    holds gradient norms: each step's norm before clipping, the clip threshold, and the fraction
    of steps clipped in each eval window."""
    if not evals:
        raise ValueError("no evaluations to plot")
    steps = [e["step"] for e in evals]
    positions = sorted(
        int(k.split("_")[1]) for k in evals[-1] if k.startswith("acc_") and k[4:].isdigit()
    )
    pooled = sorted(int(k.rsplit("_", 1)[1]) for k in evals[-1] if k.startswith("pooled_accept_len_"))
    norms = [(h["step"], h["grad_norm"]) for h in history if h.get("grad_norm") is not None]
    if norms:
        fig, (ax, low) = plt.subplots(2, 1, figsize=(8, 7), dpi=100, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        cmap = plt.get_cmap("viridis", max(2, len(positions)))
        for i, k in enumerate(positions):
            ax.plot(steps, [e.get(f"acc_{k}", float("nan")) for e in evals], marker=".",
                    color=cmap(i), label=f"acc_{k}")
        if not norms:
            ax.set_xlabel("optimizer step")
        ax.set_ylabel("accuracy (full target vocab)")
        ax.set_ylim(0.0, 1.0)
        ax.grid(alpha=0.3)
        right = ax.twinx()
        right.plot(steps, [e.get("sim_accept_len", float("nan")) for e in evals], color="black",
                   linestyle="--", label="sim accept len (+1 bonus)")
        if pooled:
            k = pooled[-1]
            right.plot(steps, [e.get(f"pooled_accept_len_{k}") or float("nan") for e in evals], color="tab:red",
                       linestyle=":", marker="x", label=f"pooled accept len, {k} drafts")
        right.set_ylabel("acceptance length")
        lines = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=7, ncol=2)
        ax.set_title(title)
        if norms:
            low.plot([s for s, _ in norms], [n for _, n in norms], color="tab:blue", linewidth=0.6,
                     label="grad norm (before clipping)")
            if max_grad_norm is not None:
                low.axhline(max_grad_norm, color="tab:blue", linestyle="--", linewidth=0.8,
                            label=f"max_grad_norm {max_grad_norm:g}")
            low.set_yscale("log")
            low.set_xlabel("optimizer step")
            low.set_ylabel("gradient norm")
            low.grid(alpha=0.3)
            rate = low.twinx()
            windows = [e for e in evals if "train_clip_rate" in e]
            rate.hlines([e["train_clip_rate"] for e in windows], [e["step"] - e["train_steps"] for e in windows],
                        [e["step"] for e in windows], color="tab:orange", label="clip rate (per eval window)")
            rate.set_ylim(0.0, 1.05)
            rate.set_ylabel("fraction of steps clipped")
            handles = low.get_legend_handles_labels()
            more = rate.get_legend_handles_labels()
            low.legend(handles[0] + more[0], handles[1] + more[1], loc="upper right", fontsize=7)
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)
