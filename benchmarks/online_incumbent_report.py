"""benchmarks/results/online-incumbent.json from an "online-incumbent" run's results folder
(`benchmarks/h200_run.py node start --plan online-incumbent`; run 8 on 2026-12-02).

    .venv/bin/python benchmarks/online_incumbent_report.py benchmarks/results/real-run-node/run-8

Issue 12's figures: the time from the last committed generation shard to a trained draft, offline
(extract, then train) against online (train with train.hidden_states online), by the run
folders' stage clocks and by the `eaglescale run` processes' walls; where each spends it (the
train stage's set-up before its first evaluation, then the steps), from the stage logs; the bytes
written for hidden states; the held-out accept length of both drafts (the gate's replay over the
same sequences, with its CI, and the trainer's last evaluation). Issue 14's: the gate's
contenders on real SGLang (the baseline, the full draft, the 1,004-sample incumbent promoted by
hand), the decision, the registry's pointer after it, and the margin over the incumbent
recomputed from the per-request records with the gate's own bootstrap (the decision computes it
only for an eligible incumbent).
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.real_run_report import Results  # noqa: E402 - after the path set-up

GOAL_RATIO = 0.6  # issue 12: online <= 0.6 x offline
_LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) \| INFO .*?(train started|eval: \{'step': (\d+))")


def train_phases(log: str) -> dict[str, float] | None:
    """The train stage's set-up (its start to the step-0 evaluation: indexing, the vocabulary,
    the model; online also the target) and its steps (step-0 evaluation to the last one), in
    seconds, from a stage log's Prefect lines."""
    started, evals = None, []
    for line in log.splitlines():
        m = _LOG_LINE.match(line)
        if not m:
            continue
        t = int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
        if m[4] == "train started":
            started = t
        else:
            evals.append((int(m[5]), t))
    if started is None or len(evals) < 2:
        return None
    (first_step, first_t), (last_step, last_t) = evals[0], evals[-1]
    assert first_step == 0
    return {"setup_s": first_t - started, "steps_s": last_t - first_t, "steps": last_step,
            "s_per_step": (last_t - first_t) / last_step}  # fmt: skip


def _contender_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    d = report["decision"]
    base = next(c for c in d["configs"] if c["name"] == d["baseline"])
    rows = [{"contender": "baseline", "config": base["name"], "median_tok_s": base["median_tok_s"],
             "rep_medians": base["rep_medians"], "speedup": 1.0, "ci": None, "accept_length": None,
             "accept_per_position": None, "exact_match_fraction": base["exact_match_fraction"], "eligible": True}]  # fmt: skip
    configs = {c["name"]: c for c in d["configs"]}
    for c in d["contenders"]:
        rows.append({"contender": c["name"], "config": c["config"], "median_tok_s": c["median_tok_s"],
                     "rep_medians": configs[c["config"]]["rep_medians"], "speedup": c["speedup"],
                     "ci": [c["ci_low"], c["ci_high"]], "accept_length": c["accept_length"],
                     "accept_per_position": configs[c["config"]]["accept_per_position"],
                     "exact_match_fraction": c["exact_match_fraction"], "eligible": c["eligible"]})  # fmt: skip
    return rows


def margin_from_records(report: dict[str, Any], new: str, incumbent: str) -> list[float] | None:
    """median(new) / median(incumbent) with its CI: the decision's bootstrap (paired by prompt,
    repetitions resampled) and settings, over the per-request records report.json keeps."""
    from tasks.gate.decision import bootstrap_speedup, tok_s_matrix
    from tasks.gate.records import RequestRecord

    records: dict[str, list[RequestRecord]] = {}
    for launch in report["bench"]["launches"]:
        for r in launch["requests"]:
            records.setdefault(r["config"], []).append(RequestRecord(**r))
    if new not in records or incumbent not in records:
        return None
    n, g = len(report["bench"]["prompts"]), report["gate_config"]
    r = bootstrap_speedup(tok_s_matrix(records[incumbent], n), tok_s_matrix(records[new], n), g["n_bootstrap"],
                          g["ci_level"], g["bootstrap_seed"])  # fmt: skip
    return list(r) if r is not None else None


def _within(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Each accept length inside the other's CI."""
    return b["ci_low"] <= a["accept_length"] <= b["ci_high"] and a["ci_low"] <= b["accept_length"] <= a["ci_high"]


def build(results: Results) -> dict[str, Any]:
    status = results.json("status.json") or {}
    m = (results.json("measurements.json") or {})["online_incumbent"]
    steps = status.get("steps", {})
    offline_s, online_s = m["offline_s"], m["online_s"]
    walls = {k: steps[k]["seconds"] for k in ("offline", "online") if "seconds" in steps.get(k, {})}
    logs = {k: (results.files.get(f"logs/stage-{k}.log") or b"").decode() for k in ("offline", "online")}
    replay = results.json("replay-compare.json") or m.get("replay") or {}
    k = str((replay.get("offline") or {}).get("num_steps", [3])[0])
    rep = {name: replay[name]["overall"][k] for name in ("offline", "online") if name in replay}
    report = results.json("run/gate/report.json")
    inc = report["decision"]["incumbent"] if report else None
    inc_config = next((c["config"] for c in report["decision"]["contenders"] if c["role"] == "incumbent"), None) if report else None
    new_config = next((c["config"] for c in report["decision"]["contenders"] if c["role"] == "candidate"), None) if report else None
    pointer = results.json("registry/promoted.json")
    data = {
        "date": datetime.fromtimestamp(status.get("started_at", 0)).strftime("%Y-%m-%d") if status else None,
        "online_vs_offline": {
            "last_generation_shard_to_trained_draft_s": {"offline": offline_s, "online": online_s},
            "offline_extract_s": m["offline_extract_s"], "offline_train_s": m["offline_train_s"],
            "ratio": online_s / offline_s,
            "goal": f"online <= {GOAL_RATIO} x offline", "met": online_s / offline_s <= GOAL_RATIO,
            "process_walls_s": walls,
            "process_walls_ratio": walls["online"] / walls["offline"] if len(walls) == 2 else None,
            "train_phases": {k: train_phases(v) for k, v in logs.items()},
            "optimizer_steps": {"offline": m["offline"]["steps"], "online": m["online"]["steps"]},
            "splits": {"offline": m["offline"]["data"]["splits"], "online": m["online"]["data"]["splits"]},
            "hidden_state_bytes": m["hidden_state_bytes"],
            "held_out_replay": rep,
            "held_out_replay_equal_within_ci": _within(rep["offline"], rep["online"]) if len(rep) == 2 else None,
            "trainer_last_eval_sim_accept_len": {k: m[k]["evals"][-1]["sim_accept_len"] for k in ("offline", "online", "small")},
            "final_train_loss": {k: m[k]["loss"][-1] if m[k]["loss"] else None for k in ("offline", "online")},
        },  # fmt: skip
        "incumbent_on_real_sglang": None if report is None else {
            "outcome": report["decision"]["outcome"],
            "reasons": report["decision"]["reasons"],
            "incumbent": inc,
            "contenders": _contender_rows(report),
            "margin_over_incumbent_from_records": margin_from_records(report, new_config, inc_config),
            "registry_after": None if pointer is None else {"draft_id": pointer["draft_id"], "evidence": pointer["evidence"]},
            "small_run_sequences": m["small"]["data"]["splits"]["train"],
        },  # fmt: skip
    }
    return data


def main() -> int:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "benchmarks/results/real-run-node/run-8")
    data = build(Results(folder))
    out = REPO / "benchmarks/results/online-incumbent.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    o = data["online_vs_offline"]
    print(f"offline {o['last_generation_shard_to_trained_draft_s']['offline']:.1f} s (extract {o['offline_extract_s']:.1f} + "
          f"train {o['offline_train_s']:.1f}), online {o['last_generation_shard_to_trained_draft_s']['online']:.1f} s: "
          f"{o['ratio']:.3f}x ({'met' if o['met'] else 'missed'}: {o['goal']}); process walls {o['process_walls_ratio']:.3f}x")  # fmt: skip
    for name, p in o["train_phases"].items():
        if p:
            print(f"  {name} train: set-up {p['setup_s']:.1f} s, {p['steps']} steps in {p['steps_s']:.1f} s ({p['s_per_step']:.3f} s/step)")
    print(f"hidden-state bytes: {o['hidden_state_bytes']}; held-out replay: "
          + ", ".join(f"{k} {v['accept_length']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]" for k, v in o["held_out_replay"].items())
          + f" (equal within CI: {o['held_out_replay_equal_within_ci']})")  # fmt: skip
    g = data["incumbent_on_real_sglang"]
    if g:
        print(f"gate: {g['outcome']}; registry after: {(g['registry_after'] or {}).get('draft_id')}")
        for r in g["contenders"]:
            ci = f" [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ci"] else ""
            print(f"  {r['contender']:<10} {r['config']:<28} {r['median_tok_s']:7.1f} tok/s  {r['speedup']:.3f}x{ci}"
                  f"  accept {r['accept_length'] or 0:.2f}  exact {r['exact_match_fraction']:.0%}")  # fmt: skip
        mg = g["margin_over_incumbent_from_records"]
        if mg:
            print(f"  margin over the incumbent (from the records): {mg[0]:.3f}x [{mg[1]:.3f}, {mg[2]:.3f}]")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
