"""benchmarks/real_run_report.py on the real H200 runs' results (as `node wait` left them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.real_run_report import scaling_slopes, write_real_run
from tests.figures_support import assert_same_figures

NODE = Path(__file__).resolve().parents[1] / "benchmarks/results/real-run-node"


def test_the_committed_real_run_json_is_what_collect_builds(tmp_path: Path) -> None:
    earlier = [NODE / f"run-{k}" for k in (7, 6, 5, 4, 3, 2, 1)]
    out = write_real_run(NODE / "run-13", tmp_path, earlier)
    data = json.loads(out.read_text())
    committed = json.loads((NODE.parent / "real-run.json").read_text())
    # The figures in README/BENCHMARKS come from these files; floats within figures_support.REL.
    assert_same_figures(data, committed)

    # Run 13 (issue 27's curve at the new recipe) carried run 9's generation and was cut short in
    # its gate's sixth launch (the machine was lost between two `node wait` calls): every draft
    # trained and replayed, and the launches that finished measured each on real SGLang once.
    assert data["pipeline"]["state"] == "running" and data["pipeline"]["steps"]["train"]["state"] == "done"
    assert data["gate"] is None
    measured13 = data["gate_measured"]
    assert (measured13["launches_done"], measured13["launches_planned"]) == (5, 7)
    assert data["training"]["steps"] == 872  # the profile's 4 epochs
    curve13 = data["scaling_curve"]
    assert curve13["from"] == "the finished launches of a gate cut short (5 of 7)"
    assert curve13["break_even_accept_length"] is None  # that is the gate's prediction, made with its decision
    points13 = {(p["kind"], p["domain"], p["samples"]): p["accept_length"] for p in curve13["points"]}
    sizes = [1004, 3011, 6022, 10036]
    measured_all = [round(points13[("measured", "all", n)], 3) for n in sizes]
    assert measured_all == [1.249, 1.476, 1.645, 1.791]
    for domain in ("all", "coding", "general_chat", "humaneval"):
        line = [points13[("replay", domain, n)] for n in sizes]
        assert line == sorted(line), (domain, line)
    # One launch a point: replay within 5% of real SGLang (the full draft's 24 prompts, 4.7%).
    assert all(abs(points13[("replay", "all", n)] / points13[("measured", "all", n)] - 1) < 0.05 for n in sizes)

    # Run 7, the "before" (3 epochs, betas 0.9/0.95), kept beside it.
    run7 = data["earlier_runs"]["run-7"]
    gen = run7["generation"]
    assert gen["prompts_regenerated"] == 10241 and gen["dead"] == 0
    # Run 7's plain batched request ran at 22.3 k tok/s (11.9-16.5 k in runs 1-6), the stage as
    # fast as in run 6: the goal is not met this time, and the JSON says so.
    assert round(gen["vs_plain_batched_request"], 3) == 0.702
    assert round(gen["reference_tok_s"]) == 22312 and round(gen["stage_tok_s"]) == 15659
    goals = {g["goal"].split(" (")[0].split(",")[0]: g for g in data["goals"]}
    regen = goals["regeneration vs one plain batched request"]
    assert regen["met"] is False and regen["run"] == "run-7"  # run 13 regenerated nothing
    # Run 7's gate (num_steps 3 alone, `--skip sweep`) ran all seven launches of its one wave,
    # each server on its own --nccl-port (run 6 lost one of ten to SGLang's own port pick), and
    # decided: REJECT, the full draft slower than the baseline beyond the spread.
    assert all(f["error"] is None for f in run7["gate_progress"]["finished"])
    assert len(run7["gate_progress"]["finished"]) == 7 and run7["gate_measured"] is None
    gate = run7["gate"]
    assert gate["summary"]["outcome"] == "reject"
    configs = {c["name"]: c for c in gate["configs"]}
    assert round(configs["baseline"]["median_tok_s"], 1) == 656.5
    full = configs["eagle3-s3-k1-n4"]
    assert round(full["accept_length"], 2) == 1.73 and full["ci_high"] < 1
    # The data-scaling curve per domain, every point measured by real SGLang with replay beside
    # it: accept length rises with the training sequences in every domain.
    curve = run7["scaling_curve"]
    points = {(p["kind"], p["domain"], p["samples"]): p["accept_length"] for p in curve["points"]}
    assert sorted({p["samples"] for p in curve["points"]}) == sizes
    for domain in ("all", "coding", "general_chat", "humaneval"):
        for kind in ("measured", "replay"):
            line = [points[(kind, domain, n)] for n in sizes]
            assert line == sorted(line), (kind, domain, line)
    assert [round(points[("measured", "all", n)], 2) for n in sizes] == [1.24, 1.38, 1.54, 1.73]
    # Replay predicts real SGLang's pooled acceptance within 3% at every point of the curve.
    assert all(abs(points[("replay", "all", n)] / points[("measured", "all", n)] - 1) < 0.03 for n in sizes)
    assert round(curve["break_even_accept_length"], 2) == 2.66
    # After against before: the new recipe's curve lies above run 7's at every point, on real
    # SGLang and in replay, and rises faster with data.
    for kind in ("measured", "replay"):
        assert all(points13[(kind, "all", n)] > points[(kind, "all", n)] for n in sizes), kind
    assert curve13["fits"]["all"]["slope_per_ln_sample"] > curve["fits"]["all"]["slope_per_ln_sample"]
    # The prediction (replay x the probes' step costs) within +/-10% for both configs in run 7.
    pred = goals["the gate's prediction"]
    assert pred["met"] is True and pred["run"] == "run-7" and max(map(abs, pred["measured"])) < 0.1
    # What run 13 could judge is its own; what it could not, the newest run's that did.
    assert goals["accept length at 3 steps"]["met"] is False and goals["accept length at 3 steps"]["run"] == "run-13"
    promote = goals["promoted config vs baseline tok/s at concurrency 1"]
    assert promote["run"] == "run-7" and promote["met"] is False  # run 13's gate made no decision
    sf_goal = goals["ours >= SpecForge's draft"]
    assert sf_goal["run"] == "run-4" and sf_goal["measured"]["specforge"] > sf_goal["measured"]["ours"]
    runs = data["earlier_runs"]
    assert list(runs) == ["run-7", "run-6", "run-5", "run-4", "run-3", "run-2", "run-1"]
    run6 = runs["run-6"]
    assert round(run6["generation"]["vs_plain_batched_request"], 3) == 0.947
    # Run 6's gate was cut short by the session's end (11 of 17 launches): the measured curve of
    # the scaling drafts, rising with data, and the launch SGLang's own NCCL port pick lost.
    assert run6["gate"] is None
    measured = run6["gate_measured"]
    assert (measured["launches_done"], measured["launches_planned"]) == (11, 17)
    rows = {r["config"]: r for r in measured["configs"]}
    curve6 = [rows[f"scaling-{n}:eagle3-s3-k1-n4"]["accept_length"] for n in (1004, 3011, 6022)]
    assert [round(a, 2) for a in curve6] == [1.21, 1.42, 1.59]
    assert "eagle3-s3-k1-n4" not in rows  # its launch died before serving
    lost = [f for f in run6["gate_progress"]["finished"] if f["error"]]
    assert [f["config"] for f in lost] == ["eagle3-s3-k1-n4"] and "EADDRINUSE" in lost[0]["error"]
    assert all(abs(r["replay_error"]) < 0.01 for r in rows.values() if "replay_error" in r)
    offline = [p["best"]["sim_accept_len"] for p in run6["training"]["curve_offline"]]
    assert [round(a, 2) for a in offline] == [1.23, 1.45, 1.65, 1.86]
    # Run 5's gate ran every launch: a decision, and every speculative config slower than the
    # baseline beyond the spread.
    run5 = runs["run-5"]
    assert round(run5["generation"]["vs_plain_batched_request"], 3) == 1.312
    gate = run5["gate"]
    assert gate["summary"]["outcome"] == "reject" and run5["gate_measured"] is None
    configs = {c["name"]: c for c in gate["configs"]}
    assert round(configs["baseline"]["median_tok_s"], 1) == 572.7
    spec = [c for c in gate["configs"] if c["spec"]]
    assert len(spec) == 6 and all(c["ci_high"] < 1 for c in spec)
    chain = [configs[f"eagle3-s{k}-k1-n{k + 1}"] for k in range(1, 6)]
    assert [round(c["accept_length"], 2) for c in chain] == [1.52, 1.66, 1.72, 1.72, 1.73]
    assert set(chain[2]["accept_length_per_domain"]) == {"coding", "general_chat", "humaneval"}
    # Their outputs left the baseline's at the same tokens launch after launch.
    outputs = gate["spec_vs_baseline_outputs"]
    assert all(row["same_across_repetitions"] for row in outputs["configs"].values())
    assert outputs["prompts_differing_at_token_0_in_every_launch"] == ["10", "22"]
    assert all(c["exact_match_fraction"] < 0.3 for c in spec)
    errors = [round(r["error"], 3) for r in gate["predicted_vs_measured"]]
    assert errors == [-0.016, 0.029, 0.132, 0.093, -0.13, 0.135]
    run4 = runs["run-4"]
    # The offline curve: three scaling drafts and the full one, acceptance rising with data.
    curve = run4["training"]["curve_offline"]
    assert [p["samples"] for p in curve] == [1004, 3011, 6022, 10036]
    accept = [p["best"]["sim_accept_len"] for p in curve]
    assert accept == sorted(accept) and round(accept[-1], 2) == 1.86
    sf = run4["specforge"]["training"]
    assert sf["steps"] == sf["planned_steps"] == run4["training"]["steps"] == 675 and not sf["stopped_early"]
    # Run 4's gate was cut short (12 of 19 launches): its launches are the evidence, no decision.
    assert run4["gate"] is None
    measured = run4["gate_measured"]
    assert (measured["launches_done"], measured["launches_planned"]) == (12, 19)
    rows = {r["config"]: r for r in measured["configs"]}
    assert round(rows["baseline"]["median_tok_s"], 1) == 616.0
    chain4 = [rows[f"eagle3-s{k}-k1-n{k + 1}"] for k in range(1, 6)]
    assert [round(r["accept_length"], 2) for r in chain4] == [1.45, 1.64, 1.75, 1.78, 1.79]
    assert all(abs(r["replay_error"]) < 0.015 for r in chain4)  # replay predicts real SGLang's acceptance
    scaling = [rows[f"scaling-{n}:eagle3-s3-k1-n4"]["accept_length"] for n in (1004, 3011, 6022)]
    assert scaling == sorted(scaling) and scaling[-1] < chain4[2]["accept_length"]
    assert all(abs(a - b) < 0.035 for a, b in zip(scaling, curve6, strict=True))  # two trainings, two gates
    assert all(r["vs_baseline_same_repetition"]["0"] < 1 for r in measured["configs"] if r["config"] != "baseline")
    assert measured["fastest_speculative"]["config"] == "eagle3-s3-k4-n8"
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


def test_collect_prints_each_run_s_gain_per_e_fold_the_new_one_first() -> None:
    """Issue 27's "before and after": the fit over all domains, measured and replayed, per run
    that has a curve; and, as if a newer run (a copy of run 13's curve, its slope doubled) were
    collected beside it, the newest first."""
    committed = json.loads((NODE.parent / "real-run.json").read_text())
    lines = scaling_slopes(committed, "run-13")
    assert lines[:2] == [
        "run-13: +0.233 tokens per verify per e-fold of data (num_steps 3; SGLang 1.249 / 1.476 / 1.645 / 1.791 at "
        "1,004 / 3,011 / 6,022 / 10,036 sequences; replay +0.265)",
        "run-7: +0.206 tokens per verify per e-fold of data (num_steps 3; SGLang 1.235 / 1.376 / 1.537 / 1.726 at "
        "1,004 / 3,011 / 6,022 / 10,036 sequences; replay +0.219)"]  # fmt: skip
    # Runs 6 and 4 were cut short in their gates: their curves come from the finished launches.
    assert [x.split(":")[0] for x in lines[2:]] == ["run-6", "run-4"]
    curve = json.loads(json.dumps(committed["scaling_curve"]))
    curve["fits"]["all"]["slope_per_ln_sample"] *= 2
    new = {"scaling_curve": curve, "earlier_runs": {"run-13": committed}}
    lines = scaling_slopes(new, "run-14")
    assert [x.split(":")[0] for x in lines] == ["run-14", "run-13"] and lines[0].startswith("run-14: +0.467 tokens")


def test_a_gate_cut_short_gives_its_curve_from_the_launches_that_finished() -> None:
    """Two repetitions of one config are averaged; the full draft stands at the train split's
    size; replay sits beside; no scaling launch, no curve."""
    from benchmarks.real_run_report import curve_from_launches

    def launch(config: str, rep: int, accept: float | None, coding: float | None = None) -> dict:
        return {"config": config, "repetition": rep, "error": None, "tok_s": 100.0, "accept_length": accept,
                "accept_length_per_domain": {} if coding is None else {"coding": coding}}  # fmt: skip

    progress = {"launches": {"done": 5, "planned": 6}, "finished": [
        launch("baseline", 0, None), launch("scaling-100:eagle3-s3-k1-n4", 0, 1.2, 1.1),
        launch("eagle3-s3-k1-n4", 0, 1.5, 1.4), launch("eagle3-s3-k1-n4", 1, 1.7, 1.6),
        launch("eagle3-s5-k1-n6", 0, 9.0)]}  # fmt: skip
    table = {"overall": {"3": {"accept_length": 1.25}}, "per_domain": {"coding": {"3": {"accept_length": 1.15}}}}
    full = {"overall": {"3": {"accept_length": 1.62}}, "per_domain": {}}
    curve = curve_from_launches(progress, full, {"100": table}, 1000)
    points = {(p["kind"], p["domain"], p["samples"]): p["accept_length"] for p in curve["points"]}
    assert points == {("measured", "all", 100): 1.2, ("measured", "coding", 100): 1.1,
                      ("measured", "all", 1000): 1.6, ("measured", "coding", 1000): 1.5,
                      ("replay", "all", 100): 1.25, ("replay", "coding", 100): 1.15,
                      ("replay", "all", 1000): 1.62}  # fmt: skip  (num_steps 5 is not the curve's)
    assert curve["num_steps"] == 3 and curve["from"] == "the finished launches of a gate cut short (5 of 6)"
    slope = curve["fits"]["all"]["slope_per_ln_sample"]
    assert abs(slope - 0.4 / math.log(10)) < 1e-9  # fitted on the measured points
    assert curve_from_launches({"finished": progress["finished"][2:4]}, full, {}, 1000) is None
    assert curve_from_launches(progress, full, {"100": table}, None) is None


def test_figures_compare_within_the_stated_tolerance_and_nothing_else() -> None:
    from tests.figures_support import figure_differences

    committed = {"slope": 0.2332700847503551, "n": 3, "points": [1.0, 2.5], "label": "x"}
    assert figure_differences({**committed, "slope": 0.23327008475035504}, committed) == []  # another BLAS path
    assert figure_differences({**committed, "slope": 0.23327009}, committed) != []  # a different figure (4e-8)
    assert figure_differences({**committed, "label": "y"}, committed) == ["$.label: 'y', committed 'x'"]
    assert figure_differences({**committed, "points": [1.0]}, committed) == ["$.points: 1 items, committed 2"]
