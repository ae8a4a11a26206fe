"""benchmarks/real_run_report.py on the two real H200 runs' results (as `node wait` left them)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.real_run_report import write_real_run

NODE = Path(__file__).resolve().parents[1] / "benchmarks/results/real-run-node"


def test_the_committed_real_run_json_is_what_collect_builds(tmp_path: Path) -> None:
    out = write_real_run(NODE / "run-2", tmp_path, NODE / "run-1")
    data = json.loads(out.read_text())
    committed = json.loads((NODE.parent / "real-run.json").read_text())
    assert data == committed  # the figures in README/BENCHMARKS come from these files

    gen = data["generation"]
    assert gen["prompts_regenerated"] == 14570 and gen["dead"] == 0
    assert round(gen["vs_plain_batched_request"], 3) == 0.924
    assert data["goals"][0]["met"] is True
    # The offline curve: three scaling drafts and the full one, acceptance rising with data.
    curve = data["training"]["curve_offline"]
    assert [p["samples"] for p in curve] == [999, 2998, 9995, 14278]
    accept = [p["best"]["sim_accept_len"] for p in curve]
    assert accept == sorted(accept) and round(accept[-1], 2) == 2.05
    # Nothing the second run did not measure is reported as met or missed.
    assert data["gate"] is None and all(g["met"] is None for g in data["goals"][1:])
    earlier = data["earlier_run"]
    assert earlier["gate"]["summary"]["outcome"] == "stopped"
    assert round(earlier["baseline"]["median_tok_s"], 1) == 714.2
    for plot in data["plots"] + earlier["plots"]:
        assert (tmp_path / Path(plot).name).stat().st_size > 10_000


def test_a_new_collect_removes_plots_an_older_one_left(tmp_path: Path) -> None:
    stale = tmp_path / "real-run-tok-s.png"
    stale.write_bytes(b"old")
    write_real_run(NODE / "run-2", tmp_path)
    assert not stale.exists()  # run-2 has no gate plots: an old one would read as its
    assert (tmp_path / "real-run-scaling-training.png").is_file()
