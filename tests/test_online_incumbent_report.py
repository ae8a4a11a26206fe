"""benchmarks/online_incumbent_report.py over the stored results of the eighth real run (the
"online-incumbent" plan): its figures agree with the raw files they come from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN8 = REPO / "benchmarks/results/real-run-node/run-8"


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(REPO))
    from benchmarks.online_incumbent_report import build
    from benchmarks.real_run_report import Results

    results = Results(RUN8)
    return build(results), results


def test_online_vs_offline_times_come_from_the_stage_clocks(report) -> None:
    data, results = report
    o = data["online_vs_offline"]
    ext, tr = results.json("run/stages/extract.json"), results.json("run/stages/train.json")
    on = results.json("run-online/stages/train.json")
    assert o["last_generation_shard_to_trained_draft_s"] == {
        "offline": pytest.approx(tr["ended_at"] - ext["started_at"]), "online": pytest.approx(on["ended_at"] - on["started_at"])}
    assert o["ratio"] == pytest.approx((on["ended_at"] - on["started_at"]) / (tr["ended_at"] - ext["started_at"]))
    assert o["met"] == (o["ratio"] <= 0.6)
    for name, clock in (("offline", tr), ("online", on)):  # the log's phases fall inside the stage's clock
        p = o["train_phases"][name]
        assert p["setup_s"] > 0 and p["steps_s"] > 0 and p["setup_s"] + p["steps_s"] < clock["ended_at"] - clock["started_at"]
        assert p["steps"] == o["optimizer_steps"][name]
    assert o["hidden_state_bytes"]["online"] == 0 and o["hidden_state_bytes"]["offline"] > 10**10
    assert o["splits"]["offline"] == o["splits"]["online"]  # the same sequences either way


def test_the_margin_over_the_incumbent_is_the_gates_bootstrap_of_its_records(report) -> None:
    data, _ = report
    g = data["incumbent_on_real_sglang"]
    rows = {r["contender"]: r for r in g["contenders"]}
    margin, low, high = g["margin_over_incumbent_from_records"]
    assert low < margin < high
    assert margin == pytest.approx(rows["new draft"]["median_tok_s"] / rows["incumbent"]["median_tok_s"])
    assert g["registry_after"]["draft_id"] == g["incumbent"]["draft_id"]  # the reject kept the incumbent
    assert g["registry_after"]["evidence"]["by_hand"] is True
    assert g["small_run_sequences"] == 1004
