"""benchmarks/load_rehearsal.py: the gate at load rehearsed end to end on the emulator, and the H200
rehearsal of record (run 25, BENCHMARKS P32) judged again from its committed records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.load_rehearsal import main, rejudge

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/real-run-node"
RUN25 = RESULTS / "run-25"


def test_the_h200_rehearsal_judged_again_gives_the_figures_of_record() -> None:
    got = rejudge(RUN25)
    chain, own = got["table"]["eagle3-s3-k1-n4"], got["table"]["serving-policy"]
    # The 3-step chain (acceptance forced to 2.58) against the baseline, by the pooled rate.
    assert [round(chain["levels"][c]["speedup"], 3) for c in ("1", "4", "16", "32", "64")] == [1.080, 1.102, 1.129, 1.028, 0.979]
    assert chain["levels"]["64"]["ci"][0] < 1.0 < chain["levels"]["64"]["ci"][1]  # within the spread at 64
    assert chain["levels"]["64"]["cap"] == 48 and chain["crossover"]["pays_up_to"] == 32
    # The launch whose tiers turned drafting off at 5-8 and from 33 on: slower than a plain server there.
    assert round(own["levels"]["8"]["speedup"], 2) == 0.66 and round(own["levels"]["64"]["speedup"], 2) == 0.36
    assert own["levels"]["8"]["accept_length"] == pytest.approx(1.0)
    # What the sweep supports now: one tier of 3 steps at every level (never 0), the cap at 64.
    policy = got["policy"]
    assert policy["kind"] == "adaptive" and policy["adaptive_config"] == {"1": {"candidate_steps": [3]}}
    assert policy["max_running_requests"] == 64
    errors = got["prediction_error"]
    assert all(abs(errors[c]["eagle3-s3-k1-n4"]) < 0.10 for c in ("2", "4", "8", "16", "32"))
    assert errors["1"]["eagle3-s3-k1-n4"] > 0.2  # the static server's measured cycle, slower than its probe's


def test_the_h100_rehearsal_ships_a_router_split_and_predicts_every_level_within_10_percent() -> None:
    got = rejudge(RESULTS / "run-26")
    chain = got["table"]["eagle3-s3-k1-n4"]
    assert [round(chain["levels"][c]["speedup"], 2) for c in ("1", "4", "32", "64")] == [1.41, 1.51, 1.06, 0.78]
    assert chain["levels"]["64"]["ci"][1] < 1.0 and chain["crossover"]["pays_up_to"] == 32
    # Slower at 64 beyond the spread: speculative servers to 32, plain servers above, by the router.
    policy = got["policy"]
    assert policy["kind"] == "router"
    assert [lv["level"] for lv in policy["levels"] if lv["wins"]] == [1, 2, 4, 8, 16, 32]
    # Above the 48-request cap the probe's first turn, stretched by the queue: -8% at 64, not -22%.
    errors = got["prediction_error"]
    assert all(abs(e) < 0.10 for level in errors.values() for e in level.values()), errors


def test_a_rehearsal_on_the_emulator_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "reh"
    assert main([str(out), "--engine", "emulated", "--levels", "1,8", "--prompts", "4", "--new-tokens", "8",
                 "--accept", "eagle3-s3-k1-n4=2.58", "--sweep-only"]) == 0  # fmt: skip
    summary = json.loads((out / "rehearsal.json").read_text())
    assert summary["outcome"] == "rehearsal" and summary["launches"] == 2
    assert summary["reasons"][0].startswith("rehearsal: acceptance forced by gate.simulated_acceptance")
    assert set(summary["table"]["eagle3-s3-k1-n4"]["levels"]) == {"1", "8"}
    assert (out / "run/gate/report.md").read_text().startswith("# Gate decision: REHEARSAL")
    assert "eagle3-s3-k1-n4" in capsys.readouterr().out
