"""Issue 28's figures from the sessions of its run on Qwen2.5-Coder-1.5B-Instruct (gpunode's
qwen plans), each session's results folder as `node wait` left it:

    .venv/bin/python benchmarks/qwen_run_report.py RESULTS_DIR [RESULTS_DIR ...]

Per session (`session`; its plan from the node's options.json): regeneration against one plain
batched request, training and what it packed to travel, each gate's configs with CIs, lossless
counts and break-even; over the run: each draft's decision of record (`records`: the first gate
that decided over it; later ones beside it in `decisions`, BENCHMARKS.md P28), the data-scaling
curve over every draft (`run_curve`) and the issue's goals, each met or missed by how much
(`goals`). Writes `qwen-run.json` (in the first RESULTS_DIR unless --out says where),
`qwen-run-gates.png` (`plot_gates`) and `qwen-run-curve.png` beside it, and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.real_run_report import (  # noqa: E402
    CONFIG_NAME,
    Results,
    config_rows,
    generation_figures,
    measured_launches,
    prediction_rows,
    replay_accept_length,
)
from gpunode.travel import PACKED, calls_for  # noqa: E402
from tasks.gate.report import figure_png  # noqa: E402
from tasks.gate.scaling import (  # noqa: E402
    MEASURED,
    OVERALL,
    REPLAY,
    ScalingPoint,
    curve_png,
    fit_trend,
    fittable,
    replay_points,
    scaling_report,
)

S3 = "eagle3-s3-k1-n4"  # num_steps 3, topk 1: the goals' config
GOAL_SPEEDUP = 1.3
GOAL_ACCEPT = 2.5
GOAL_ACCEPT_DOMAINS = ("humaneval", "coding")  # held-out HumanEval, ShareGPT code
GOAL_REGENERATION = 0.95
GOAL_PREDICTION = 0.10
PROFILE = REPO / "deployments/params/qwen25-coder.yaml"


def _goal(name: str, target: str, measured: Any, met: bool | None, short_by: Any = None) -> dict[str, Any]:
    return {"goal": name, "target": target, "measured": measured, "met": met, "short_by": short_by}


def session(folder: Path, reference: set[str] | None = None) -> dict[str, Any]:
    """One session's figures: its plan, its steps' clocks, and what it measured (with
    `reference`, its full draft's replay pooled over those held-out prompts too)."""
    results = Results(folder)
    options = results.json("options.json") or {}
    status = results.json("status.json") or {}
    measure = results.json("measurements.json") or {}
    out: dict[str, Any] = {
        "folder": str(folder), "plan": options.get("plan"), "settings": options.get("settings"),
        "state": status.get("state"), "carried": results.json("carried.json"),
        "steps_s": {k: v.get("seconds") for k, v in (status.get("steps") or {}).items()},
        "versions": measure.get("versions"), "target_resolve_s": measure.get("target_resolve_s"),
        "host": measure.get("host"),  # the machine (gpunode.setup.host_facts): runs 17 and 18 differ in cycle cost
    }  # fmt: skip
    progress = results.json("run/generate/progress.json")
    if progress and not (out["carried"] or {}).get("generation"):
        out["generation"] = {**generation_figures(progress, measure), **(measure.get("generate_concurrency") or {})}
    fit = results.json("train-fit.json")
    train = results.json("run/train/result.json")
    if fit or (train and not (out["carried"] or {}).get("draft")):
        waits = [h["data_wait_s"] for h in (train or {}).get("history", []) if "data_wait_s" in h]
        out["training"] = {"fit": fit, "steps": (train or {}).get("steps"), "best": (train or {}).get("best"),
                           "epochs_for_budget": measure.get("train_epochs"),  # epochs_within_budget's choice
                           # a step's wait for its batch (online: captured by the target beside the step)
                           "data_wait_s_mean": sum(waits) / len(waits) if waits else (fit or {}).get("data_wait_s_mean")}  # fmt: skip
    report, replayed = results.json("run/gate/report.json"), results.json("run/gate/replay.json")
    if report:
        out["gate"] = gate_figures(report, results.json("run/gate/prediction.json"), replayed)
    else:  # a gate cut short: its finished launches, no decision
        cut = measured_launches(results.json("run/gate/progress.json"), replayed)
        if cut:
            out["gate_cut_short"] = cut
    gate = out.get("gate") or out.get("gate_cut_short")
    if gate and measure.get("gate_trimmed"):  # configs the node left out for the device time (gate_within_budget)
        gate["trimmed"] = measure["gate_trimmed"]
    scaling = results.json("run/gate/scaling/report.json") or replayed_curve(results)
    if scaling:
        out["scaling"] = scaling_figures(scaling)
    out["train_sequences"] = train_sequences(results)
    pooled = replay_on_reference(replayed, results.json("run/run.json"), reference) if reference else None
    if pooled:
        out["replay_on_reference_held_out"] = pooled
    packed = travelled(measure, out["steps_s"])
    if packed:
        out["travelled"] = packed
    return out


def travelled(measure: dict[str, Any], steps_s: dict[str, Any]) -> dict[str, Any]:
    """What the session packed for the next one to carry in (the draft, or the checkpoint of a
    draft stopped mid-schedule): its bytes, parts and the calls that bring it back, the step it
    stopped at, and how long the node took to pack it."""
    out = {}
    for name, step in PACKED.items():
        index = measure.get(name)
        if index:
            # Before run 19 the pack was noted done without a start: ~0 s, not a time (None).
            pack_s = steps_s.get(step) if (steps_s.get(step) or 0) > 0.01 else None
            out[name] = {"bytes": index["bytes"], "parts": len(index["parts"]), "calls": calls_for(index["bytes"]),
                         "pack_s": pack_s, **{k: index[k] for k in ("step", "total_steps") if k in index}}  # fmt: skip
    return out


def server_accept_ci(report: dict[str, Any], config: str, n_bootstrap: int = 2000, seed: int = 0,
                     ci_level: float = 0.95) -> dict[str, dict[str, Any]]:
    """A config's accept length on the server per domain with a bootstrap CI that resamples its
    prompts (each prompt's requests over every launch together: greedy repeats are one sample,
    not several), pooled as the gate pools it (tasks.gate.plan.accept_length: the prefill's token
    left out). The goal is read per domain on 24 prompts each; the CI says how near a miss is."""
    from tasks.gate.replay import pooled_with_ci

    per_prompt: dict[str, dict[str, list[int]]] = {}
    for launch in (report.get("bench") or {}).get("launches", []):
        if launch.get("config") != config:
            continue
        for r in launch.get("requests") or []:
            if r.get("error") is None and r.get("spec_verify_ct"):
                sums = per_prompt.setdefault(r["domain"], {}).setdefault(r["prompt_id"], [0, 0])
                sums[0] += r["completion_tokens"] - 1
                sums[1] += r["spec_verify_ct"]
    return {d: pooled_with_ci([t for t, _ in p.values()], [c for _, c in p.values()], n_bootstrap, seed, ci_level)
            for d, p in sorted(per_prompt.items())}  # fmt: skip


def gate_figures(report: dict[str, Any], prediction: dict[str, Any] | None,
                 replay: dict[str, Any] | None = None) -> dict[str, Any]:
    decision = report["decision"]
    rows = config_rows(report)
    for row, c in zip(rows, decision["configs"], strict=True):
        row["lossless"] = c.get("lossless")
        row["replay_accept_length"] = replay_accept_length(row["name"], replay)
        row["accept_length_ci_per_domain"] = server_accept_ci(report, row["name"])
    breakeven = (decision.get("breakeven") or {}).get("per_steps") or {}
    return {
        "outcome": decision["outcome"], "best": decision.get("best"), "speedup": decision.get("speedup"),
        "ci": [decision.get("ci_low"), decision.get("ci_high")], "reasons": decision.get("reasons", [])[:3],
        "promoted": (report.get("summary") or {}).get("outcome") == "promote",
        "configs": rows, "predicted_vs_measured": prediction_rows(report, prediction),
        "breakeven": {k: {key: v.get(key) for key in ("break_even", "side", "model_break_even", "draft_accept_length",
                                                       "statement", "points")} for k, v in breakeven.items()},
    }  # fmt: skip


def samples_for(fit: dict[str, Any], accept: float) -> float | None:
    """Training sequences at which a log-linear fit (intercept + slope * ln samples) reaches
    `accept`; None when it does not rise."""
    slope = fit.get("slope_per_ln_sample") or 0.0
    if slope <= 0:
        return None
    return math.exp(min((accept - fit["intercept"]) / slope, 700.0))  # capped: JSON has no infinity


def replayed_curve(results: Results) -> dict[str, Any] | None:
    """The curve's replayed half where the gate wrote no curve (run 20: it replays every draft
    before its first launch, and that session ended before its launches): the scaling drafts'
    replays and the full draft's, at the training sequences each trained on, fitted as the gate
    fits them (tasks/gate/scaling.py), with no break-even (the server measures that, on its own
    scale)."""
    drafts, full = results.json("run/gate/scaling/replay.json"), results.json("run/gate/replay.json")
    index = results.json("run/train/scaling/index.json") or {}
    if not drafts or not full or not index.get("train_sequences"):
        return None
    at = str(full["num_steps"][0])
    points = [p for n, r in sorted(drafts.items(), key=lambda kv: int(kv[0]))
              for p in replay_points(int(n), r["overall"], r["per_domain"], at)]  # fmt: skip
    points += replay_points(int(index["train_sequences"]), full["overall"], full["per_domain"], at)
    return {**scaling_report(points, None, int(at)), "replayed_only": True}


def train_sequences(results: Results) -> int | None:
    """The training sequences of the draft a session trained or carried in: its run/train/data.json
    (the node's results hold it from run 25 on; run 23's was taken from the drafts it packed),
    else the scaling drafts' index, which records its full draft's (run 20's: run 18's draft)."""
    splits = (results.json("run/train/data.json") or {}).get("splits") or {}
    if splits.get("train") is not None:
        return int(splits["train"])
    index = results.json("run/train/scaling/index.json") or {}
    return index.get("train_sequences")


def scaling_figures(scaling: dict[str, Any]) -> dict[str, Any]:
    curve: dict[str, dict[str, dict[str, float]]] = {}
    for p in scaling.get("points", []):
        curve.setdefault(p["domain"], {}).setdefault(str(p["samples"]), {})[p["kind"]] = p["accept_length"]
    fits = scaling.get("fits") or {}

    def overall(kind: str) -> list[int]:  # the sample counts of one kind of point, overall
        return sorted({int(p["samples"]) for p in scaling.get("points", []) if p["kind"] == kind and p["domain"] == OVERALL})

    return {
        "num_steps": scaling.get("num_steps"),
        # The sample counts a server measured: the curve's measured half; and the replayed half.
        "measured_points": overall(MEASURED), "replayed_points": overall(REPLAY),
        "replayed_only": bool(scaling.get("replayed_only")), "curve_points": scaling.get("points", []),
        "curve": curve, "fits": fits, "no_fit": scaling.get("no_fit"),
        "break_even_accept_length": scaling.get("break_even_accept_length"),
        "samples_for_accept": {d: samples_for(f, GOAL_ACCEPT) for d, f in fits.items()},
        "samples_for_break_even": {d: f.get("samples_for_break_even") for d, f in fits.items()},
    }  # fmt: skip


def _config(gate: dict[str, Any] | None, name: str) -> dict[str, Any]:
    return next((c for c in (gate or {}).get("configs", []) if c["name"] == name), {})


def _label(s: dict[str, Any]) -> str:
    return f"{Path(s['folder']).name} {s['plan']}"


def _draft_of(sessions: list[dict[str, Any]]) -> list[str]:
    """Which draft each session's gate measured, named by the session that made it: its own, or
    for a session that carried one in, the last made before it (a session makes a draft when it
    trains one to its end)."""
    out, made = [], None
    for s in sessions:
        carried = bool((s.get("carried") or {}).get("draft"))
        own = Path(s["folder"]).name
        out.append((made or own) if carried else own)
        if not carried and (s.get("training") or {}).get("steps"):
            made = own
    return out


def records(sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each draft's decision of record, in session order: the first gate that decided over it (a
    later one over the same draft is in `decisions`, beside)."""
    seen: dict[str, dict[str, Any]] = {}
    for s, draft in zip(sessions, _draft_of(sessions), strict=True):
        if (s.get("gate") or {}).get("outcome") and draft not in seen:
            seen[draft] = {"draft": draft, "session": Path(s["folder"]).name, "plan": s["plan"], "gate": s["gate"]}
    return list(seen.values())


def _meets(gate: dict[str, Any]) -> bool:
    best = _config(gate, gate["best"]) if gate.get("best") else {}
    return bool(gate.get("promoted")) and (best.get("speedup") or 0) >= GOAL_SPEEDUP and (best.get("ci_low") or 0) > 1


def _deciding(made: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The record the goals read, of `made` (records): the first draft's whose gate promoted at
    the goal, else the latest draft's."""
    return next((r for r in made if _meets(r["gate"])), made[-1] if made else None)


def _cut_short_s3(sessions: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """num_steps 3 as the latest gate cut short measured it (its launches: accept lengths are
    measurements; only the decision needs the whole gate), and which session that was."""
    for s in reversed(sessions):
        row = next((c for c in (s.get("gate_cut_short") or {}).get("configs", []) if c["config"] == S3), None)
        if row:
            return row, s["folder"]
    return {}, None


def _tree_at_3_steps(name: str) -> bool:
    """The candidate's config at num_steps 3 with topk > 1 (CONFIG_NAME)."""
    m = CONFIG_NAME.match(name)
    return bool(m) and m["draft"] is None and m["s"] == "3" and m["k"] != "1"


def run_curve(sessions: list[dict[str, Any]], made: list[dict[str, Any]],
              break_even: float | None) -> dict[str, Any] | None:  # fmt: skip
    """The run's data-scaling curve at 3 steps, over every draft it made: each session's scaling
    curve (a gate's, measured and replayed, or run 20's replayed half), and each draft of record at
    the sequences it trained on: the server's accept length where its record's gate measured 3
    steps (`records`: one measurement a draft, never the better of two), and its replay on the
    reference held-out split (run 15's, on which every scaling draft was replayed). One point a
    draft, kind and domain; each carries the draft it is of. Fitted as the gate fits a curve
    (tasks/gate/scaling.py: on a domain's measured points where it has two sample counts, else on
    its replayed ones), with the server's break-even at 3 steps; beside it the replayed points'
    own fit, so that a reader sees what offline replay alone would say."""
    drafts = _draft_of(sessions)
    sequences: dict[str, int] = {}
    for s, draft in zip(sessions, drafts, strict=True):
        if s.get("train_sequences") is not None:
            sequences.setdefault(draft, s["train_sequences"])
    points: dict[tuple[str, str, str], ScalingPoint] = {}

    def add(draft: str, point: ScalingPoint) -> None:
        points.setdefault((draft, point.kind, point.domain), point)

    for s, draft in zip(sessions, drafts, strict=True):
        for p in (s.get("scaling") or {}).get("curve_points", []):
            # The session's full draft is the one it trained or carried; the others its scaling drafts.
            owner = draft if p["samples"] == sequences.get(draft) else f"{Path(s['folder']).name} at {p['samples']}"
            add(owner, ScalingPoint(p["domain"], int(p["samples"]), float(p["accept_length"]), p["kind"]))
    for record in made:
        n = sequences.get(record["draft"])
        if n is None:
            continue
        s3 = _config(record["gate"], S3)
        measured = {OVERALL: s3.get("accept_length"), **(s3.get("accept_length_per_domain") or {})}
        for domain, accept in measured.items():
            if accept is not None:
                add(record["draft"], ScalingPoint(domain, n, float(accept), MEASURED))
        replayed = next((s["replay_on_reference_held_out"] for s, d in zip(sessions, drafts, strict=True)
                         if d == record["draft"] and s.get("replay_on_reference_held_out")), None)  # fmt: skip
        if replayed:
            tables = {OVERALL: replayed, **replayed["per_domain"]}
            for domain, t in tables.items():
                add(record["draft"], ScalingPoint(domain, n, float(t["accept_length"]), REPLAY))
    if not points:
        return None
    ordered = sorted(points.items(), key=lambda kv: (kv[1].samples, kv[0]))
    report = scaling_report([p for _, p in ordered], break_even, 3)
    report["points"] = [{"draft": key[0], **vars(p)} for key, p in ordered]
    replayed_fits = fit_trend(fittable([p for _, p in ordered if p.kind == REPLAY])[0])
    # the domains whose trend the server's points give (fittable's choice), the others replay's
    measured = {p.domain for p in fittable([p for _, p in ordered])[0] if p.kind == MEASURED}
    return {**scaling_figures(report), "drafts": {key[0]: p.samples for key, p in ordered},
            "measured_domains": sorted(measured),
            "replayed_fits": {d: {"intercept": f.intercept, "slope_per_ln_sample": f.slope, "points": f.points,
                                  "samples_for_accept": f.samples_for(GOAL_ACCEPT)} for d, f in replayed_fits.items()}}  # fmt: skip


def plot_curve(curve: dict[str, Any]) -> bytes:
    """qwen-run-curve.png: the run's curve (run_curve) as the gate plots one, with the goal."""
    points = [ScalingPoint(p["domain"], p["samples"], p["accept_length"], p["kind"]) for p in curve["curve_points"]]
    return curve_png(points, curve["break_even_accept_length"], goal=(f"the goal at 3 steps, {GOAL_ACCEPT}", GOAL_ACCEPT))


def goals(sessions: list[dict[str, Any]], deciding: dict[str, Any] | None,
          scaling: dict[str, Any] | None) -> list[dict[str, Any]]:  # fmt: skip
    """The issue's goals, the promotion and accept-length ones read from `deciding` (the
    record's gate, _deciding), the curve's from `scaling` (run_curve)."""
    # The latest session that regenerated: a later one re-measures (run 16 without the prefix cache).
    gen = next((s["generation"] for s in reversed(sessions) if s.get("generation")), {})
    out = []
    ratio = gen.get("vs_plain_batched_request")
    out.append(_goal("regeneration vs one plain batched request on the same server", f">= {GOAL_REGENERATION}",
                     ratio, None if ratio is None else ratio >= GOAL_REGENERATION,
                     None if ratio is None or ratio >= GOAL_REGENERATION else GOAL_REGENERATION - ratio))  # fmt: skip
    if deciding:
        best = _config(deciding, deciding["best"]) if deciding.get("best") else {}
        speedup, low = best.get("speedup"), best.get("ci_low")
        met = _meets(deciding)
        short = None if met or speedup is None else {"speedup": max(0.0, GOAL_SPEEDUP - speedup),
                                                      "ci_low_below_1": max(0.0, 1 - (low or 0))}  # fmt: skip
        out.append(_goal("the gate promotes a config at concurrency 1, CUDA graphs", f">= {GOAL_SPEEDUP}x, CI above 1",
                         {"outcome": deciding["outcome"], "config": deciding.get("best"), "speedup": speedup,
                          "ci": [low, best.get("ci_high")]}, met, short))  # fmt: skip
    else:  # no decision; a gate cut short shows how far its launches got
        cut = next((s["gate_cut_short"] for s in reversed(sessions) if (s.get("gate_cut_short") or {}).get("configs")), None)
        measured = cut and {"outcome": None, "cut_short_at": cut["cut_short_at"],
                            "launches": f"{cut['launches_done']} of {cut['launches_planned']}",
                            "fastest_speculative": cut["fastest_speculative"]}  # fmt: skip
        out.append(_goal("the gate promotes a config at concurrency 1, CUDA graphs", f">= {GOAL_SPEEDUP}x, CI above 1",
                         measured, None))  # fmt: skip
    per_domain = _config(deciding, S3).get("accept_length_per_domain") or _cut_short_s3(sessions)[0].get(
        "accept_length_per_domain") or {}
    accepts = {d: per_domain.get(d) for d in GOAL_ACCEPT_DOMAINS}
    known = [v for v in accepts.values() if v is not None]
    ci = _config(deciding, S3).get("accept_length_ci_per_domain") or {}
    measured_accept = accepts | ({"ci": {d: [ci[d]["ci_low"], ci[d]["ci_high"]] for d in GOAL_ACCEPT_DOMAINS if d in ci}}
                                 if ci else {})  # fmt: skip
    out.append(_goal("accept length at 3 steps on held-out HumanEval and ShareGPT code", f">= {GOAL_ACCEPT} each",
                     measured_accept, None if len(known) < len(accepts) else all(v >= GOAL_ACCEPT for v in known),
                     {d: GOAL_ACCEPT - v for d, v in accepts.items() if v is not None and v < GOAL_ACCEPT} or None))  # fmt: skip
    errors = [r["error"] for s in sessions for r in (s.get("gate") or {}).get("predicted_vs_measured", [])
              if r.get("error") is not None]  # fmt: skip
    worst = max((abs(e) for e in errors), default=None)
    out.append(_goal("the gate's predicted tok/s vs measured", f"within +/-{GOAL_PREDICTION:.0%}", errors,
                     None if worst is None else worst <= GOAL_PREDICTION,
                     None if worst is None or worst <= GOAL_PREDICTION else worst - GOAL_PREDICTION))  # fmt: skip
    points = (scaling or {}).get("replayed_points") or []
    measured = (scaling or {}).get("measured_points") or []
    short = {k: 4 - len(v) for k, v in (("replayed", points), ("measured", measured)) if len(v) < 4}
    out.append(_goal("the data-scaling curve, measured and replayed", ">= 4 points each",
                     {"replayed": points, "measured": measured},
                     None if scaling is None else not short, short or None))  # fmt: skip
    return out


def decisions(sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every gate that decided, in session order: its plan, outcome, best config with speedup and
    CI, and whether its node's registry promoted the draft."""
    return [{"session": Path(s["folder"]).name, "plan": s["plan"],
             **{k: s["gate"][k] for k in ("outcome", "best", "speedup", "ci", "promoted")}}
            for s in sessions if (s.get("gate") or {}).get("outcome")]  # fmt: skip


def _breakeven_at_3_steps(deciding: dict[str, Any] | None, sessions: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The break-even the server measured at num_steps 3: the deciding gate's, else that of the
    last session that measured it (qwen-sweep's, through gate.breakeven_num_steps)."""
    for gate in [deciding, *(s.get("gate") for s in reversed(sessions))]:
        row = ((gate or {}).get("breakeven") or {}).get("3")
        if row:
            return row
    return None


def reference_holdout(generation: Path, profile: Path = PROFILE) -> set[str]:
    """The prompt ids whose sequences a run's training held out (extract.eval_fraction per
    domain, ranked by a seeded hash: tasks.extract.sequences.eval_prompt_ids), for the run whose
    generation.tar this is: run 15's, on whose 205 held-out sequences run 20's curve was replayed."""
    import tarfile

    import pyarrow.parquet as pq

    from tasks.config import load_config
    from tasks.extract.sequences import conversation_ids, manifest_eval_ids

    with tarfile.open(generation) as tar:
        member = tar.extractfile("run/prompts/manifest.parquet")
        if member is None:
            raise ValueError(f"{generation}: no run/prompts/manifest.parquet in it")
        manifest = pq.read_table(member, columns=["prompt_id", "domain", "messages"])
    pids = manifest.column("prompt_id").to_pylist()
    domains = dict(zip(pids, manifest.column("domain").to_pylist(), strict=True))
    extract = load_config(profile).extract
    conversations = (conversation_ids(dict(zip(pids, manifest.column("messages").to_pylist(), strict=True)))
                     if extract.holdout_unit == "conversation" else None)  # fmt: skip
    return manifest_eval_ids(domains, extract.eval_fraction, extract.seed, conversations)


def replay_on_reference(replayed: dict[str, Any] | None, run: dict[str, Any] | None, reference: set[str],
                        num_steps: int = 3) -> dict[str, Any] | None:  # fmt: skip
    """A session's full-draft replay pooled over the reference held-out prompts alone (their
    sequences in its run: request ids from its run.json's fingerprint), so that a draft trained
    on a grown set compares with the curve's replayed points on the same sequences; and each
    domain's (per_domain: the accept-length goal is read per domain). None when its replay kept
    no per-sequence records or it replayed none."""
    from tasks.gate.replay import replayed_on
    from tasks.runfolder import request_id

    if not replayed or not run or not run.get("fingerprint_hash"):
        return None
    ids = {request_id(run["fingerprint_hash"], pid, 0) for pid in reference}
    pooled = replayed_on(replayed, ids, num_steps)
    if not pooled:
        return None
    domains: dict[str, set[str]] = {}
    for record in replayed["per_sequence"]:
        if record["sequence_id"] in ids:
            domains.setdefault(record["domain"], set()).add(record["sequence_id"])
    per_domain = {d: replayed_on(replayed, members, num_steps) for d, members in sorted(domains.items())}
    return {"num_steps": num_steps, **pooled, "reference_held_out": len(reference), "per_domain": per_domain}


def build(folders: list[Path], reference: set[str] | None = None) -> dict[str, Any]:
    """`reference`: the held-out prompt ids every full draft's replay is also pooled over
    (reference_holdout; main: the first folder's generation.tar, run 15's)."""
    sessions = [session(f, reference) for f in folders]
    made = records(sessions)
    record = _deciding(made)
    deciding = record and record["gate"]
    # each gate's, by session (runs 19 and 24 were both qwen-sweep)
    measured_at_3 = {_label(s): _config(s.get("gate"), S3).get("accept_length_per_domain")
                     for s in sessions if _config(s.get("gate"), S3)}  # fmt: skip
    # 3 steps with topk > 1 beside the chain (run 18's tree: 2.24 on HumanEval where the chain had 1.92)
    measured_at_3 |= {f"{_label(s)} {c['name']}": c.get("accept_length_per_domain") for s in sessions
                      for c in (s.get("gate") or {}).get("configs", []) if _tree_at_3_steps(c["name"])}  # fmt: skip
    breakeven = _breakeven_at_3_steps(deciding, sessions)
    scaling = run_curve(sessions, made, breakeven and breakeven.get("break_even"))
    cut_s3, cut_folder = _cut_short_s3(sessions)
    if cut_s3 and cut_folder not in {s["folder"] for s in sessions if _config(s.get("gate"), S3)}:
        measured_at_3[f"{cut_folder} (a gate cut short)"] = cut_s3.get("accept_length_per_domain")
    result = {
        "what": "Qwen2.5-Coder-1.5B-Instruct (its Q4_K_M GGUF from 22 package parts, converted to bf16) on ShareGPT V3 "
                "+ HumanEval: regenerated, trained online, gated on real SGLang 0.5.14 on one H200 (runs 21, 23 and 24: "
                "one H100; each session's host says which), over sessions",
        "sessions": sessions,
        "decision": record and {"draft": record["draft"], "session": record["session"], "plan": record["plan"],
                                **{k: record["gate"][k] for k in ("outcome", "best", "speedup", "ci", "promoted", "reasons")}},
        "records": [{k: r[k] for k in ("draft", "session", "plan")} | {"outcome": r["gate"]["outcome"]}
                    for r in made],
        "decisions": decisions(sessions),
        "accept_length_at_3_steps_per_domain": measured_at_3,
        "breakeven_at_3_steps": breakeven,
        "scaling": scaling,
        "goals": goals(sessions, deciding, scaling),
    }  # fmt: skip
    missed = [g for g in result["goals"] if g["met"] is False]
    if missed:  # what the issue asks of a miss: the measured break-even and the data the curve says is needed
        # Each measured config's cycle cost as launched, per session (accept length x the baseline's
        # tok/s / its own): the same config's differs between sessions (run 17 vs run 18 at 3 steps).
        from_launches: dict[str, dict[str, float]] = {}
        for p in gate_points(result):
            if p.get("break_even"):
                from_launches.setdefault(p["session"], {})[p["config"]] = p["break_even"]
        result["if_missed"] = {"breakeven_at_3_steps": result["breakeven_at_3_steps"],
                               "samples_for_accept": (scaling or {}).get("samples_for_accept"),
                               "samples_for_break_even": (scaling or {}).get("samples_for_break_even"),
                               "break_even_from_launches": from_launches}  # fmt: skip
    return result


def gate_points(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every speculative config a session's gate measured, one point each for the plot: its
    speed against the baseline (a decided gate's speedup and CI, else the ratio of each launch to
    the baseline's launch of the same repetition), its accept length on real SGLang, offline
    replay's where it ran, and the accept length at which it would break even."""
    points = []
    for s in result["sessions"]:
        label = _label(s)
        for c in (s.get("gate") or {}).get("configs", []):
            if c["name"] != "baseline" and c.get("speedup"):
                points.append({"session": label, "config": c["name"], "vs_baseline": [c["speedup"]],
                               "ci": [c["ci_low"], c["ci_high"]], "accept_length": c["accept_length"],
                               "replay": c.get("replay_accept_length"),
                               "break_even": c["accept_length"] / c["speedup"] if c["accept_length"] else None})  # fmt: skip
        for c in (s.get("gate_cut_short") or {}).get("configs", []):
            if c["config"] != "baseline" and c.get("vs_baseline_same_repetition"):
                points.append({"session": f"{label} (cut short)", "config": c["config"],
                               "vs_baseline": list(c["vs_baseline_same_repetition"].values()), "ci": None,
                               "accept_length": c["accept_length"], "replay": c.get("replay_accept_length"),
                               "break_even": c.get("break_even_accept_length")})  # fmt: skip
    return points


def plot_gates(points: list[dict[str, Any]]) -> bytes:
    """Left: each config's tok/s against the baseline (a dot per launch of a gate cut short; a
    decided gate's speedup with its CI), with 1 and the 1.3x goal. Right: each config's accept
    length on real SGLang (offline replay's beside it) and the accept length at which its
    measured cycle cost breaks even: a config wins where its bar stands above its break-even."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"{p['config']}\n{p['session']}" for p in points]
    for i, p in enumerate(points):
        left.scatter([i] * len(p["vs_baseline"]), p["vs_baseline"], color="tab:blue", zorder=3)
        if p["ci"] and None not in p["ci"]:
            left.vlines(i, p["ci"][0], p["ci"][1], color="tab:blue")
    left.axhline(1.0, color="tab:gray", linestyle=":", label="the baseline")
    left.axhline(GOAL_SPEEDUP, color="tab:green", linestyle="--", label=f"the goal, {GOAL_SPEEDUP}x")
    left.set_xticks(range(len(points)), names, rotation=70, fontsize=7)
    left.set_ylabel("tok/s / the baseline's, concurrency 1")
    left.set_title("real SGLang 0.5.14 on one H200 or H100 (each session's host), CUDA graphs", fontsize=9)
    left.legend()
    x = list(range(len(points)))
    right.bar([i - 0.2 for i in x], [p["accept_length"] or 0 for p in points], width=0.4, label="accept length, real SGLang")
    right.bar([i + 0.2 for i in x], [p.get("replay") or 0 for p in points], width=0.4, label="offline replay", alpha=0.6)
    right.scatter(x, [p["break_even"] for p in points], marker="_", s=600, color="tab:red", zorder=3,
                  label="break-even at its measured cycle cost")  # fmt: skip
    right.axhline(GOAL_ACCEPT, color="tab:green", linestyle="--", label=f"the goal at 3 steps, {GOAL_ACCEPT}")
    right.set_xticks(x, names, rotation=70, fontsize=7)
    right.set_ylabel("tokens per verify")
    right.set_title("accept length against what each config needs")
    right.legend(fontsize=7)
    return figure_png(fig)


def _count(samples: float | None) -> str:
    return "no figure (a flat trend)" if samples is None else f"{samples:,.0f}"


def _print(result: dict[str, Any]) -> None:
    for s in result["sessions"]:
        print(f"{s['folder']}: plan {s['plan']}, {s['state']}, steps {s['steps_s']}")
        if s.get("host"):
            print(f"  host: {s['host']}")
        if s.get("generation"):
            g = s["generation"]
            print(f"  regeneration {g.get('stage_tok_s')} tok/s vs plain batched {g.get('reference_tok_s')}: "
                  f"{g.get('vs_plain_batched_request')}")  # fmt: skip
        if s.get("training"):
            print(f"  training: {s['training']}")
        if s.get("replay_on_reference_held_out"):
            r = s["replay_on_reference_held_out"]
            print(f"  replay on run 15's held-out prompts ({r['sequences']} of {r['reference_held_out']} here), "
                  f"{r['num_steps']} steps: {r['accept_length']} [{r['ci_low']}, {r['ci_high']}]; "
                  + ", ".join(f"{d} {p['accept_length']:.3f} ({p['sequences']})" for d, p in r["per_domain"].items()))  # fmt: skip
        for name, t in (s.get("travelled") or {}).items():
            print(f"  packed to travel: {name}, {t['bytes']} bytes in {t['parts']} parts ({t['calls']} calls), "
                  + (f"packed in {t['pack_s']:.0f} s" if t["pack_s"] is not None else "the pack not timed") + (f", at step {t['step']} of {t['total_steps']}" if "step" in t else ""))  # fmt: skip
        cut = s.get("gate_cut_short")
        if cut:
            print(f"  gate cut short at {cut['cut_short_at']!r}, {cut['launches_done']} of {cut['launches_planned']} launches: "
                  "no decision")  # fmt: skip
            for c in cut["configs"]:
                print(f"    {c['config']}: {c['tok_s']} tok/s, vs baseline {c['vs_baseline_same_repetition']}, "
                      f"accept {c['accept_length']} {c['accept_length_per_domain']}, break-even accept "
                      f"{c.get('break_even_accept_length')}")  # fmt: skip
        gate = s.get("gate")
        if gate:
            print(f"  gate: {gate['outcome'].upper()} best {gate['best']} {gate['speedup']} CI {gate['ci']}")
            if gate.get("trimmed"):
                print(f"    left out for the device time: {gate['trimmed']['left_out']}")
            for c in gate["configs"]:
                print(f"    {c['name']}: {c['median_tok_s']} tok/s, speedup {c['speedup']} [{c['ci_low']}, {c['ci_high']}], "
                      f"accept {c['accept_length']} {c['accept_length_per_domain']}")  # fmt: skip
            for k, row in gate["breakeven"].items():
                print(f"    break-even, num_steps {k}: {row['statement']}")
    curve = result.get("scaling")
    if curve:
        print(f"curve at {curve['num_steps']} steps: drafts at {curve['drafts']} sequences; measured at "
              f"{curve['measured_points']}, replayed at {curve['replayed_points']}")  # fmt: skip
        for d, fit in curve["fits"].items():
            basis = "measured" if d in curve["measured_domains"] else "replayed"
            print(f"  {d}: {fit['slope_per_ln_sample']:+.3f} per e-fold ({basis}, {fit['points']} points): "
                  f"{GOAL_ACCEPT} at {_count(curve['samples_for_accept'].get(d))} sequences; the replayed points alone "
                  f"say {_count((curve['replayed_fits'].get(d) or {}).get('samples_for_accept'))}")  # fmt: skip
    for g in result["goals"]:
        verdict = {True: "met", False: f"MISSED by {g['short_by']}", None: "not measured"}[g["met"]]
        print(f"goal {g['goal']} ({g['target']}): {g['measured']} -> {verdict}")
    for d in result["decisions"]:
        print(f"decision {d['session']} {d['plan']}: {d['outcome'].upper()} {d['best']} {d['speedup']} CI {d['ci']}"
              f"{', promoted in its registry' if d['promoted'] else ''}")
    if result.get("if_missed"):
        print(f"if missed: {result['if_missed']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="each session's folder of what `node wait` brought back")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: RESULTS_DIR/qwen-run.json, the first)")
    args = parser.parse_args()
    first = args.results[0] / "generation.tar"  # run 15's: the held-out set run 20's curve was replayed on
    result = build(args.results, reference_holdout(first) if first.is_file() else None)
    out = args.out or args.results[0] / "qwen-run.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    points = gate_points(result)
    if points:  # beside the JSON: qwen-run-gates.png
        plot = out.with_name(f"{out.stem}-gates.png")
        plot.write_bytes(plot_gates(points))
        print(plot)
    if result["scaling"]:  # and qwen-run-curve.png
        plot = out.with_name(f"{out.stem}-curve.png")
        plot.write_bytes(plot_curve(result["scaling"]))
        print(plot)
    _print(result)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
