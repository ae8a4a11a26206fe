"""P5's measurement helpers: the predicted-vs-measured rows and the markdown table printed at
the end."""

from __future__ import annotations

from typing import Any


def compare(pred: dict[str, Any], bench: dict[str, Any], steps: list[int]) -> list[dict[str, Any]]:
    rows = [{"config": "baseline", "predicted_tok_s": pred["baseline_tok_s"],
             "measured_tok_s": bench["baseline"]["tok_s"]}]  # fmt: skip
    for k in steps:
        m = bench[f"spec_k{k}"]
        p = pred["per_steps"][str(k)]
        rows.append({"config": f"spec_k{k}", "predicted_tok_s": p["tok_s"], "measured_tok_s": m["tok_s"],
                     "replay_accept": p["accept_length"], "measured_accept": m["accept_length"],
                     "break_even_accept": p["break_even_accept_length"], "exact_match": m["exact_match"]})  # fmt: skip
    for r in rows:
        r["error"] = r["predicted_tok_s"] / r["measured_tok_s"] - 1.0 if r["measured_tok_s"] else None
    return rows


def print_table(results: dict[str, Any]) -> None:
    print("\n| mode | config | predicted tok/s | measured tok/s | error | error, synced costs | replay accept | measured accept | outputs = baseline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        n = r["bench"]["baseline"]["requests"]
        for c, sc in zip(r["compare"], r["synced_compare"], strict=True):
            base = c["config"] == "baseline"
            err = "(calibration) | (calibration)" if base else f"{c['error']:+.1%} | {sc['error']:+.1%}"
            match = f"{round(c['exact_match'] * n)}/{n}" if "exact_match" in c else "-"
            replay_a = f"{c['replay_accept']:.3f}" if "replay_accept" in c else "-"
            measured_a = f"{c['measured_accept']:.3f}" if "measured_accept" in c else "-"
            print(f"| {mode} | {c['config']} | {c['predicted_tok_s']:.1f} | {c['measured_tok_s']:.1f} | {err} | "
                  f"{replay_a} | {measured_a} | {match} |")  # fmt: skip

