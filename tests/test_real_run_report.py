"""benchmarks/real_run_report.py on the real H200 runs' results (as `node wait` left them)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.real_run_report import write_real_run

NODE = Path(__file__).resolve().parents[1] / "benchmarks/results/real-run-node"


def test_the_committed_real_run_json_is_what_collect_builds(tmp_path: Path) -> None:
    out = write_real_run(NODE / "run-4", tmp_path, [NODE / "run-3", NODE / "run-2", NODE / "run-1"])
    data = json.loads(out.read_text())
    committed = json.loads((NODE.parent / "real-run.json").read_text())
    assert data == committed  # the figures in README/BENCHMARKS come from these files

    gen = data["generation"]
    assert gen["prompts_regenerated"] == 10241 and gen["dead"] == 0
    assert round(gen["vs_plain_batched_request"], 3) == 1.458
    assert data["goals"][0]["met"] is True
    # The offline curve: three scaling drafts and the full one, acceptance rising with data.
    curve = data["training"]["curve_offline"]
    assert [p["samples"] for p in curve] == [1004, 3011, 6022, 10036]
    accept = [p["best"]["sim_accept_len"] for p in curve]
    assert accept == sorted(accept) and round(accept[-1], 2) == 1.86
    sf = data["specforge"]["training"]
    assert sf["steps"] == sf["planned_steps"] == data["training"]["steps"] == 675 and not sf["stopped_early"]
    # The gate was cut short (12 of 19 launches): its launches are the evidence, no decision.
    assert data["gate"] is None
    measured = data["gate_measured"]
    assert (measured["launches_done"], measured["launches_planned"]) == (12, 19)
    rows = {r["config"]: r for r in measured["configs"]}
    assert round(rows["baseline"]["median_tok_s"], 1) == 616.0
    chain = [rows[f"eagle3-s{k}-k1-n{k + 1}"] for k in range(1, 6)]
    assert [round(r["accept_length"], 2) for r in chain] == [1.45, 1.64, 1.75, 1.78, 1.79]
    assert all(abs(r["replay_error"]) < 0.015 for r in chain)  # replay predicts real SGLang's acceptance
    scaling = [rows[f"scaling-{n}:eagle3-s3-k1-n4"]["accept_length"] for n in (1004, 3011, 6022)]
    assert scaling == sorted(scaling) and scaling[-1] < chain[2]["accept_length"]
    assert all(r["vs_baseline_same_repetition"]["0"] < 1 for r in measured["configs"] if r["config"] != "baseline")
    assert measured["fastest_speculative"]["config"] == "eagle3-s3-k4-n8"
    goals = {g["goal"].split(" (")[0].split(",")[0]: g for g in data["goals"]}
    assert goals["accept length at 3 steps"]["met"] is False
    assert goals["ours >= SpecForge's draft"]["measured"]["specforge"] > goals["ours >= SpecForge's draft"]["measured"]["ours"]
    assert goals["promoted config vs baseline tok/s at concurrency 1"]["met"] is False
    assert data["goals"][-1]["met"] is None  # no step costs, no tok/s prediction
    runs = data["earlier_runs"]
    assert list(runs) == ["run-3", "run-2", "run-1"]
    assert runs["run-3"]["generation"]["prompts_regenerated"] == 10241 and runs["run-3"]["gate"] is None
    assert runs["run-2"]["generation"]["prompts_regenerated"] == 14570
    assert round(runs["run-2"]["training"]["curve_offline"][-1]["best"]["sim_accept_len"], 2) == 2.05
    assert runs["run-1"]["gate"]["summary"]["outcome"] == "stopped"
    assert round(runs["run-1"]["baseline"]["median_tok_s"], 1) == 714.2
    plots = data["plots"] + [p for r in runs.values() for p in r.get("plots", [])]
    for plot in plots:
        assert (tmp_path / Path(plot).name).stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(Path(p).name for p in plots)


def test_a_new_collect_removes_plots_an_older_one_left(tmp_path: Path) -> None:
    stale = tmp_path / "real-run-tok-s.png"
    stale.write_bytes(b"old")
    write_real_run(NODE / "run-4", tmp_path)
    assert not stale.exists()  # run-4 has no gate report plots: an old one would read as its
    assert (tmp_path / "real-run-scaling-training.png").is_file()
