"""The cost model on constructed costs, with the numbers worked out by hand."""

from __future__ import annotations

import pytest

from tasks.gate.cost_model import (
    CostModelError,
    StepCosts,
    calibrate_overhead,
    costs_from_step_records,
    predict,
    queued_step,
)
from tasks.sglang.command import resolve_spec

COSTS = {
    "baseline_step_s": 0.010,
    "verify_s": {"2": 0.012, "4": 0.014, "6": 0.016},
    "draft_step_s": 0.001,
    "source": "hand",
}


def test_prediction_by_hand():
    pred = predict(COSTS, {1: 1.5, 3: 2.0, 5: 2.1})
    assert pred.baseline_tok_s == pytest.approx(100.0)
    k1, k3, k5 = pred.per_steps[1], pred.per_steps[3], pred.per_steps[5]
    # k=1: verify 2 tokens 0.012 + 1 draft step 0.001 = 0.013 s per cycle for 1.5 tokens.
    assert k1["cycle_s"] == pytest.approx(0.013)
    assert k1["tok_s"] == pytest.approx(1.5 / 0.013)
    assert k1["break_even_accept_length"] == pytest.approx(1.3)
    # k=3: 0.014 + 3 * 0.001 = 0.017 s for 2.0 tokens; k=5: 0.016 + 0.005 = 0.021 s for 2.1.
    assert k3["tok_s"] == pytest.approx(2.0 / 0.017)
    assert k3["speedup"] == pytest.approx(2.0 / 0.017 / 100.0)
    assert k5["tok_s"] == pytest.approx(100.0) and k5["break_even_accept_length"] == pytest.approx(2.1)
    assert pred.best_num_steps == 3
    assert list(pred.to_dict()["per_steps"]) == ["1", "3", "5"]


def test_measured_draft_cycles_and_overhead():
    costs = {**COSTS, "draft_cycle_s": {"3": 0.0025}, "overhead_s": 0.002}
    pred = predict(costs, {1: 1.2, 3: 1.5})
    assert pred.baseline_tok_s == pytest.approx(1 / 0.012)
    assert pred.per_steps[3]["cycle_s"] == pytest.approx(0.014 + 0.0025 + 0.002)  # measured cycle wins
    assert pred.per_steps[1]["cycle_s"] == pytest.approx(0.012 + 0.001 + 0.002)  # k * draft_step_s
    # Neither beats the baseline (1.2 < 1.25 and 1.5 < 1.5417 break-even): no best num_steps.
    assert pred.per_steps[1]["break_even_accept_length"] == pytest.approx(0.015 / 0.012)
    assert pred.best_num_steps is None


def test_calibrated_overhead_reproduces_the_measured_baseline():
    calibrated = calibrate_overhead(StepCosts.from_dict(COSTS), measured_baseline_tok_s=80.0)
    assert calibrated.overhead_s == pytest.approx(1 / 80 - 0.010)
    assert predict(calibrated, {3: 2.0}).baseline_tok_s == pytest.approx(80.0)
    assert calibrated.to_dict()["verify_s"] == {"2": 0.012, "4": 0.014, "6": 0.016}


def test_gate_prediction_names_are_the_gates_config_names():
    pred = predict(COSTS, {1: 1.5, 3: 2.0})
    spec3, _ = resolve_spec("/drafts/x", 3, 1)
    spec1, _ = resolve_spec("/drafts/x", 1, 1)
    assert pred.gate_predictions() == {
        "baseline": pytest.approx(100.0),
        spec1.label: pytest.approx(1.5 / 0.013),
        spec3.label: pytest.approx(2.0 / 0.017),
    }
    assert spec3.label == "eagle3-s3-k1-n4"


def test_sglang_step_records():
    records = [
        {"kind": "baseline", "tokens": 1, "step_time_s": 0.010},
        {"kind": "baseline", "tokens": 1, "step_time_s": 0.012},
        {"kind": "baseline", "tokens": 1, "step_time_s": 0.030},  # an outlier: the median ignores it
        {"kind": "verify", "tokens": 4, "step_time_s": 0.014},
        {"kind": "draft", "tokens": 3, "step_time_s": 0.003},
    ]
    costs = costs_from_step_records(records)
    assert costs.baseline_step_s == pytest.approx(0.012)
    assert costs.verify_s == {4: 0.014} and costs.draft_cycle_s == {3: 0.003}
    assert costs.source == "sglang"
    assert predict(costs, {3: 2.0}).per_steps[3]["cycle_s"] == pytest.approx(0.017)
    with pytest.raises(CostModelError, match=r"step record 1: kind must be baseline, verify or draft, got 'prefill'"):
        costs_from_step_records([records[0], {"kind": "prefill", "tokens": 9, "step_time_s": 0.1}])
    with pytest.raises(CostModelError, match=r"step record 0: step_time_s must be a positive number"):
        costs_from_step_records([{"kind": "baseline", "tokens": 1, "step_time_s": -1}])
    with pytest.raises(CostModelError, match="no baseline records"):
        costs_from_step_records(records[3:])


def test_bad_costs_and_acceptance_are_named():
    with pytest.raises(CostModelError, match=r"verify_s lacks 3 tokens \(has \[2, 4, 6\]\)"):
        predict(COSTS, {2: 1.5})
    with pytest.raises(CostModelError, match=r"no draft cost for num_steps 3"):
        predict({"baseline_step_s": 0.01, "verify_s": {"4": 0.014}}, {3: 2.0})
    with pytest.raises(CostModelError, match=r"unknown keys \['verify'\]"):
        StepCosts.from_dict({**COSTS, "verify": {}})
    with pytest.raises(CostModelError, match="baseline_step_s is missing"):
        StepCosts.from_dict({"verify_s": {"2": 0.01}})
    with pytest.raises(CostModelError, match=r"verify_s\['4'\] must be a positive number of seconds, got 0"):
        StepCosts.from_dict({**COSTS, "verify_s": {"4": 0}})
    with pytest.raises(CostModelError, match=r"verify_s: key 'four' is not an integer"):
        StepCosts.from_dict({**COSTS, "verify_s": {"four": 0.01}})
    with pytest.raises(CostModelError, match=r"acceptance length 4.5 for num_steps 3 is outside \[1, 4\]"):
        predict(COSTS, {3: 4.5})
    # The local engine's measurement dict is accepted as it is.
    measured = {**COSTS, "draft_cycle_s": {"1": 0.001}, "cuda_graphs": True, "device": "cuda:0"}
    assert StepCosts.from_dict(measured).draft_cycle_s == {1: 0.001}


def test_a_step_above_the_running_request_cap_is_its_first_turn_stretched_by_the_queue():
    # A server capped at 48: a probe batch of 64 runs 48, then 16. Its probe (6 ms) is the two
    # turns' steps; the 48-turn's is 6 - step(16) = 4 ms, and a request under a steady load of 64
    # holds a slot 48/64 of the time: 4 * 64 / 48 ms. step(16) is read between the probes at 8
    # and 32 when 16 was not probed.
    probes = {"1": {"step_s": 0.001}, "16": {"step_s": 0.002}, "32": {"step_s": 0.003}, "64": {"step_s": 0.006}}
    assert queued_step(probes, 64, 48) == pytest.approx(0.004 * 64 / 48)
    assert queued_step(probes, 32, 48) == 0.003  # below the cap: the probe's own
    assert queued_step(probes, 64, None) == 0.006  # no cap reported
    between = {"8": {"step_s": 0.0015}, "32": {"step_s": 0.003}, "64": {"step_s": 0.006}}
    assert queued_step(between, 64, 48) == pytest.approx((0.006 - 0.002) * 64 / 48)
    # Three turns at a cap of 24 (24, 24, 16): 2 * step(24) + step(16) = 6 ms.
    assert queued_step(probes, 64, 24) == pytest.approx((0.006 - 0.002) / 2 * 64 / 24)


def test_requests_admitted_one_at_a_time_stall_each_other_at_their_config_s_admission_cost():
    """Under load with replies that end at their own lengths, a request of n tokens is stalled by
    the admissions of the others while it runs, each at its config's admit_s (0: the baseline's)."""
    costs = StepCosts.from_dict({"baseline_step_s": 0.002, "cycle_s": {"3": 0.004}, "prefill_s": 0.03,
                                 "admit_s": {"0": 0.005, "3": 0.010}})  # fmt: skip
    assert StepCosts.from_dict(costs.to_dict()) == costs
    alone = predict(costs, {3: 2.5}, tokens_per_request=101)
    loaded = predict(costs, {3: 2.5}, tokens_per_request=101, admissions=7)
    # 101 tokens: 0.03 s prefill, 100 steps of 0.002 s (or 40 cycles of 0.004 s), 7 admissions.
    assert alone.baseline_tok_s == pytest.approx(101 / 0.23)
    assert loaded.baseline_tok_s == pytest.approx(101 / (0.23 + 7 * 0.005))
    assert loaded.per_steps[3]["tok_s"] == pytest.approx(101 / (0.03 + 0.16 + 7 * 0.010))
    # The speculative server pays twice the baseline's per admission here: its lead shrinks.
    assert loaded.per_steps[3]["speedup"] < alone.per_steps[3]["speedup"]
