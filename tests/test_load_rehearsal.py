"""benchmarks/load_rehearsal.py: the gate at load rehearsed end to end on the emulator, and the H200
rehearsal of record (run 25, BENCHMARKS P32) judged again from its committed records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.load_rehearsal import main, rejudge

RUN25 = Path(__file__).resolve().parents[1] / "benchmarks/results/real-run-node/run-25"


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
