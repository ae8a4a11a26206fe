"""benchmarks/real_run_report.py on the real H200 runs' results (as `node wait` left them)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.real_run_report import write_real_run

NODE = Path(__file__).resolve().parents[1] / "benchmarks/results/real-run-node"


def test_the_committed_real_run_json_is_what_collect_builds(tmp_path: Path) -> None:
    out = write_real_run(NODE / "run-3", tmp_path, [NODE / "run-2", NODE / "run-1"])
    data = json.loads(out.read_text())
    committed = json.loads((NODE.parent / "real-run.json").read_text())
    assert data == committed  # the figures in README/BENCHMARKS come from these files

    gen = data["generation"]
    assert gen["prompts_regenerated"] == 10241 and gen["dead"] == 0
    assert round(gen["vs_plain_batched_request"], 3) == 1.239
    assert data["goals"][0]["met"] is True
    # The offline curve: three scaling drafts and the full one, acceptance rising with data.
    curve = data["training"]["curve_offline"]
    assert [p["samples"] for p in curve] == [1004, 3011, 6022, 10036]
    accept = [p["best"]["sim_accept_len"] for p in curve]
    assert accept == sorted(accept) and round(accept[-1], 2) == 1.85
    # SpecForge trained every planned step on the same batches; no gate measured either draft.
    sf = data["specforge"]["training"]
    assert sf["steps"] == sf["planned_steps"] == data["training"]["steps"] == 678 and not sf["stopped_early"]
    assert data["gate"] is None and all(g["met"] is None for g in data["goals"][1:])
    runs = data["earlier_runs"]
    assert list(runs) == ["run-2", "run-1"]
    assert runs["run-2"]["generation"]["prompts_regenerated"] == 14570
    assert round(runs["run-2"]["training"]["curve_offline"][-1]["best"]["sim_accept_len"], 2) == 2.05
    assert runs["run-1"]["gate"]["summary"]["outcome"] == "stopped"
    assert round(runs["run-1"]["baseline"]["median_tok_s"], 1) == 714.2
    plots = data["plots"] + [p for r in runs.values() for p in r["plots"]]
    for plot in plots:
        assert (tmp_path / Path(plot).name).stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(Path(p).name for p in plots)


def test_a_new_collect_removes_plots_an_older_one_left(tmp_path: Path) -> None:
    stale = tmp_path / "real-run-tok-s.png"
    stale.write_bytes(b"old")
    write_real_run(NODE / "run-3", tmp_path)
    assert not stale.exists()  # run-3 has no gate plots: an old one would read as its
    assert (tmp_path / "real-run-scaling-training.png").is_file()
