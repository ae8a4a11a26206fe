"""benchmarks/lossless_report.py: the re-judging of recorded divergences, and the committed figures
of the H200's runs 9 and 11 (BENCHMARKS.md P9, P12) as the script reads them from the results it brought back."""

from __future__ import annotations

from pathlib import Path

from benchmarks.lossless_report import collect, rejudge

RUN_9 = Path(__file__).resolve().parents[1] / "benchmarks/results/real-run-node/run-9"
RUN_11 = RUN_9.parent / "run-11"


def record(a: float, b: float, top: list[float], cls: str = "not_lossless", penalty: float = 0.0) -> dict:
    return {"cls": cls, "baseline_logprob": a, "speculative_logprob": b, "threshold": 0.5, "penalty": penalty,
            "gap": abs(a - b), "top": [[i, lp] for i, lp in enumerate(top)]}  # fmt: skip


def test_a_recorded_divergence_is_judged_again_by_the_rule_as_it_stands() -> None:
    # Three tokens tied within 0.125 (run 9, request 5, position 57): a near-tie now.
    assert rejudge(record(-1.272, -1.397, [-1.272, -1.272, -1.397])) == "near_tie"
    # Close to each other, but both far below the best: not lossless.
    assert rejudge(record(-1.0, -1.1, [-0.2, -1.0, -1.1])) == "not_lossless"
    assert rejudge(record(-0.2, -1.0, [-0.2, -1.0])) == "not_lossless"  # a gap beyond the threshold
    # With a penalty the best's penalized logprob is not in the record: only a wide gap decides.
    assert rejudge(record(-1.0, -1.1, [-0.2, -1.0, -1.1], penalty=1.0)) == "undetermined"
    assert rejudge(record(-1.0, -2.0, [-0.2, -1.0, -2.0], penalty=1.0)) == "not_lossless"
    assert rejudge(record(-1.0, -1.1, [-1.0, -1.1], cls="near_tie", penalty=1.0)) == "near_tie"


def test_run_9_figures() -> None:
    fig = collect(RUN_9)
    gate = fig["gate"]["configs"]
    assert gate["baseline"]["as_judged"] == {"compared": 24, "exact": 24, "near_tie": 0, "not_lossless": 0, "no_evidence": 0}
    assert gate["eagle3-s1-k1-n2"]["as_judged"]["not_lossless"] == 6
    assert gate["eagle3-s1-k1-n2"]["rejudged"] == {"near_tie": 38, "not_lossless": 0, "no_evidence": 0, "undetermined": 0}
    assert [gate[f"eagle3-s{k}-k1-n{k + 1}"]["rejudged"]["near_tie"] for k in (3, 5)] == [36, 34]
    assert all(v["gaps"]["> 0.5"] == 0 for v in gate.values())
    penalty = fig["penalty_gate"]["configs"]["eagle3-s3-k1-n4"]
    assert fig["penalty_gate"]["outcome"] == "reject" and penalty["rejudged"]["not_lossless"] == 8
    be = fig["gate"]["breakeven"]["per_steps"]
    assert round(be["3"]["break_even"], 2) == 2.91 and round(be["5"]["break_even"], 2) == 2.51


def test_run_11_figures_the_one_flip_beyond_the_bound() -> None:
    """The recipe gate's three drafts (P12): every first divergence within 0.25 nats but one
    prompt's, refused in both launches at 0.5625, which re-judging does not change."""
    fig = collect(RUN_11)
    assert "gate" not in fig and fig["recipe_gate"]["outcome"] == "reject"
    gate = fig["recipe_gate"]["configs"]
    flipped = gate["challenger-epochs4:eagle3-s3-k1-n4"]
    assert flipped["as_judged"]["not_lossless"] == 2 and flipped["rejudged"]["not_lossless"] == 2
    assert flipped["gaps"]["> 0.5"] == 2 and flipped["gaps"]["<= 0.5"] == 0
    others = [v for k, v in gate.items() if "epochs4" not in k]
    assert len(others) == 3 and all(v["gaps"]["<= 0.5"] + v["gaps"]["> 0.5"] == 0 for v in others)  # none beyond 0.25
    assert "0.562 nats > 0.5" in flipped["reasons"][0]
