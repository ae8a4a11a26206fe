"""Bootstrap CI and the promote/reject rules, on benchmark results built record by record."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.config.gate_section import GateConfig
from tasks.gate.decision import bootstrap_speedup, decide, summarize, tok_s_matrix
from tasks.gate.lossless import NEAR_TIE, NOT_LOSSLESS, PositionView, ReferenceEvidence, classify
from tasks.gate.plan import BenchConfig
from tasks.gate.prompts import BenchPrompt
from tasks.gate.records import BenchResult, LaunchRecord, RequestRecord
from tasks.sglang.command import SpecParams

PROMPTS = [BenchPrompt(i, f"p{i}", "chat" if i % 2 else "code", (4, 5, 6)) for i in range(6)]
CFG = GateConfig(repetitions=3, n_bootstrap=1000, acceptance_floor=1.3)
REFERENCE = list(range(20, 40))  # every prompt's reference output in these hand-built results


def evidence(at: int, top: list[tuple[int, float]]) -> ReferenceEvidence:
    """A re-score of REFERENCE: confident everywhere, `top` (best first) at position `at`."""
    views = [PositionView(t, -0.01, ((t, -0.01), (7, -6.0), (8, -7.0), (9, -8.0), (10, -9.0))) for t in REFERENCE]
    views[at] = PositionView(REFERENCE[at], dict(top).get(REFERENCE[at]), tuple(top))
    return ReferenceEvidence((*views, PositionView(None, None, ((2, -0.1), (7, -3.0)))), k=len(top))


def diverging(at: int, token: int, top: list[tuple[int, float]], threshold: float = 0.5) -> dict:
    """The divergence record of an output that emits `token` at `at` (then anything)."""
    ids = REFERENCE[:at] + [token] + [99] * (len(REFERENCE) - at - 1)
    d = classify(REFERENCE, ids, None, None, evidence(at, top), threshold)
    assert d is not None
    return d.to_dict()


NOT_LOSSLESS_AT_7 = diverging(7, 11, [(27, -0.02), (11, -4.5), (12, -5.0), (13, -5.5), (14, -6.0)])


def spec_config(steps: int, env: str = "default") -> BenchConfig:
    suffix = "" if env == "default" else f"@{env}"
    return BenchConfig(f"eagle3-s{steps}-k1-n{steps + 1}{suffix}", SpecParams("/d", steps, 1, steps + 1), env)


def add_launches(result: BenchResult, config: BenchConfig, rep_tok_s: list[float], *, accept: float = 2.5,
                 exact: bool = True, errors: int = 0, graph_problems: list[str] | None = None,
                 divergence: dict | None = None) -> None:  # fmt: skip
    """One launch per repetition; request tok/s = the repetition's value x a per-prompt factor.
    exact=False: every speculative request (every baseline one after the first launch, the
    reference) diverges as `divergence` says (default: not lossless at token 7)."""
    for rep, level in enumerate(rep_tok_s):
        launch = LaunchRecord(config.name, config.env_name, rep, "http://x", "x.log",
                              graph_problems=list(graph_problems or []))  # fmt: skip
        for p in PROMPTS:
            tokens = 61
            r = RequestRecord(config.name, config.env_name, rep, p.index, p.prompt_id, p.domain,
                              completion_tokens=tokens, tok_s=level * (1 + 0.02 * (p.index - 2.5)), finish="stop")  # fmt: skip
            r.latency_s = tokens / r.tok_s
            if not config.is_baseline:
                r.spec_verify_ct = round((tokens - 1) / accept)
                r.correct_drafts_histogram = [2, 3, 5, 14]
            r.reference = config.is_baseline and rep == 0
            r.exact_match = exact or r.reference
            if not r.exact_match:
                r.divergence = divergence or NOT_LOSSLESS_AT_7
                r.first_mismatch = r.divergence["position"]
            if p.index < errors:
                r.error, r.tok_s = "HTTP 500: boom", None
            launch.requests.append(r)
        result.launches.append(launch)


def result_with(*configs: BenchConfig) -> BenchResult:
    return BenchResult(list(configs), PROMPTS, CFG.repetitions)


BASE = BenchConfig("baseline", None, "default")


def test_bootstrap_separates_a_clear_speedup_and_covers_no_change() -> None:
    rng = np.random.default_rng(1)
    base = 100 + rng.normal(0, 3, size=(3, 20))
    fast = 2 * base + rng.normal(0, 3, size=(3, 20))
    point, low, high = bootstrap_speedup(base, fast, 2000, 0.95, seed=0)
    assert 1.9 < low < point < high < 2.1
    same = 100 + rng.normal(0, 3, size=(3, 20))
    _, low, high = bootstrap_speedup(base, same, 2000, 0.95, seed=0)
    assert low < 1.0 < high
    assert bootstrap_speedup(base, fast, 500, 0.9, seed=7) == bootstrap_speedup(base, fast, 500, 0.9, seed=7)
    assert bootstrap_speedup(np.full((2, 3), np.nan), fast[:, :3], 100, 0.9, 0) is None


def test_summary_numbers() -> None:
    spec = spec_config(3)
    result = result_with(BASE, spec)
    add_launches(result, BASE, [100, 102, 98])
    add_launches(result, spec, [150, 160, 155], accept=3.0, errors=1)
    s = summarize(spec, result)
    assert (s.n_requests, s.n_errors, s.n_compared) == (18, 3, 15)
    assert s.rep_medians == pytest.approx([150, 160, 155], rel=0.02)
    assert s.accept_length == pytest.approx(3.0)
    # histogram [2, 3, 5, 14] over 24 cycles: P(pos 1) = 22/24, P(pos 2) = 19/24, P(pos 3) = 14/24
    assert s.accept_per_position == pytest.approx([22 / 24, 19 / 24, 14 / 24])
    m = tok_s_matrix(result.records(spec.name), len(PROMPTS))
    assert m.shape == (3, 6) and int(np.isnan(m).sum()) == 3


def test_a_faster_config_is_promoted_and_the_best_is_chosen() -> None:
    s2, s3 = spec_config(2), spec_config(3)
    result = result_with(BASE, s2, s3)
    add_launches(result, BASE, [100, 103, 97])
    add_launches(result, s2, [140, 142, 139])
    add_launches(result, s3, [180, 177, 183])
    d = decide(result, CFG)
    assert (d.outcome, d.best, d.baseline) == ("promote", s3.name, "baseline")
    assert 1.7 < d.ci_low < d.speedup < d.ci_high < 1.9
    assert d.reasons[0].startswith("faster than the baseline beyond the spread: eagle3-s3-k1-n4: median 180")
    summary = d.summary()
    assert set(summary) == {"outcome", "best_config", "baseline_config", "baseline_median_tok_s", "best_median_tok_s",
                            "speedup", "ci", "ci_level", "accept_length", "exact_match_fraction", "reasons",
                            "best_spec", "incumbent", "contenders", "left_out", "lossless", "deploy_concurrency",
                            "serving_policy"}  # fmt: skip
    assert summary["ci"] == [d.ci_low, d.ci_high]
    # What a later gate measures this draft at when it is the incumbent (gate.incumbent: evidence).
    assert summary["best_spec"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}
    assert summary["incumbent"] is None and summary["left_out"] == []
    assert [c["name"] for c in summary["contenders"]] == ["new draft"] and summary["contenders"][0]["config"] == s3.name


def test_inside_the_noise_slower_and_disagreeing_are_rejected() -> None:
    spec = spec_config(3)
    noisy = result_with(BASE, spec)
    add_launches(noisy, BASE, [100, 80, 120])
    add_launches(noisy, spec, [125, 85, 105])
    d = decide(noisy, CFG)
    assert d.outcome == "reject" and d.ci_low <= 1.0 < d.ci_high
    assert d.reasons[0].startswith("within the run-to-run spread:") and d.reasons[0].endswith("the CI includes 1.0")

    slow = result_with(BASE, spec)
    add_launches(slow, BASE, [100, 101, 99])
    add_launches(slow, spec, [70, 72, 69])
    d = decide(slow, CFG)
    assert d.outcome == "reject" and d.reasons[0].startswith("slower than the baseline:")

    wrong = result_with(BASE, spec)
    add_launches(wrong, BASE, [100, 101, 99])
    add_launches(wrong, spec, [200, 201, 199], exact=False)
    d = decide(wrong, CFG)
    assert (d.outcome, d.best) == ("reject", None)
    assert d.reasons[:2] == [
        "no speculative config is eligible",
        f"{spec.name}: not lossless: request 0 (prompt p0, repetition 0), position 7: baseline token 27 (logprob -0.020) "
        "vs speculative 11 (logprob -4.500), gap 4.480 nats > 0.5 (and 17 more requests not lossless)",
    ]
    # ... and how fast it was: fast but wrong reads differently from slow and wrong.
    assert d.reasons[2].startswith(f"fastest measured (not eligible): faster than the baseline beyond the spread: {spec.name}")

    slow_wrong = result_with(BASE, spec)
    add_launches(slow_wrong, BASE, [100, 101, 99])
    add_launches(slow_wrong, spec, [70, 72, 69], exact=False)
    d = decide(slow_wrong, CFG)
    assert d.outcome == "reject" and len(d.reasons) == 3
    assert d.reasons[2].startswith(f"fastest measured (not eligible): slower than the baseline: {spec.name}")


def test_min_speedup_and_graph_problems() -> None:
    spec = spec_config(3)
    modest = result_with(BASE, spec)
    add_launches(modest, BASE, [100, 101, 99])
    add_launches(modest, spec, [110, 111, 109])
    strict = CFG.model_copy(update={"min_speedup": 1.2})
    d = decide(modest, strict)
    assert d.outcome == "reject" and d.reasons[0].startswith("speedup below min_speedup 1.2:")

    no_graphs = result_with(BASE, spec)
    add_launches(no_graphs, BASE, [100, 101, 99])
    add_launches(no_graphs, spec, [200, 201, 199], graph_problems=["no draft CUDA-graph capture in the server log"])
    d = decide(no_graphs, CFG)
    assert d.outcome == "reject"
    assert d.reasons[1] == f"{spec.name}: no draft CUDA-graph capture in the server log"
    lenient = CFG.model_copy(update={"require_cuda_graphs": False})
    assert decide(no_graphs, lenient).outcome == "promote"


def test_stopped_runs_and_broken_baselines() -> None:
    spec = spec_config(3)
    stopped = result_with(BASE, spec)
    add_launches(stopped, BASE, [100])
    stopped.stopped = "acceptance stuck at 1.0: check --speculative-algorithm EAGLE3 and the aux hidden states"
    d = decide(stopped, CFG)
    assert (d.outcome, d.reasons) == ("stopped", [stopped.stopped])

    broken = result_with(BASE, spec)
    add_launches(broken, BASE, [100, 101, 99], errors=2)
    add_launches(broken, spec, [200, 201, 199])
    d = decide(broken, CFG)
    assert d.outcome == "reject"
    assert d.reasons == ["no valid baseline: baseline: 6 of 18 requests failed"]


def test_the_reference_is_the_fastest_baseline_across_environments() -> None:
    b0, b1 = BASE, BenchConfig("baseline@env1", None, "env1", {"NCCL_ALGO": "Tree"})
    s0, s1 = spec_config(3), spec_config(3, "env1")
    result = result_with(b0, s0, b1, s1)
    add_launches(result, b0, [100, 101, 99])
    add_launches(result, s0, [150, 151, 149])
    add_launches(result, b1, [140, 141, 139])  # this environment speeds the baseline up too
    add_launches(result, s1, [160, 161, 159])
    d = decide(result, CFG)
    assert (d.baseline, d.best, d.outcome) == ("baseline@env1", s1.name, "promote")
    assert d.speedup == pytest.approx(160 / 140, rel=0.01)


def test_gate_config_rejects_bad_thresholds_by_name() -> None:
    with pytest.raises(ValueError, match="num_steps must be distinct integers >= 1, got \\[2, 2\\]"):
        GateConfig(num_steps=[2, 2])
    with pytest.raises(ValueError, match="repetitions"):
        GateConfig(repetitions=1)
    with pytest.raises(ValueError, match="min_speeedup"):
        GateConfig(min_speeedup=1.1)
    with pytest.raises(ValueError, match="nothing to benchmark"):
        GateConfig(num_steps=[], topk_points=[])


def test_report_redaction_is_word_wise() -> None:
    from tasks.redaction import redact_secret_keys as redact

    info = {"api_key": "sk-1", "tokenizer_path": "/t", "max_prefill_tokens": 8, "env": {"HF_TOKEN": "x"}}
    assert redact(info) == {"api_key": "[redacted]", "tokenizer_path": "/t", "max_prefill_tokens": 8,
                            "env": {"HF_TOKEN": "[redacted]"}}  # fmt: skip
    # A token id is a number, never a credential: a divergence's tokens stay readable in report.json.
    divergence = {"baseline_token": 27068, "speculative_token": 13855, "access_token": "t0k", "token": 0}
    assert redact(divergence) == {"baseline_token": 27068, "speculative_token": 13855, "access_token": "[redacted]",
                                  "token": 0}  # fmt: skip


def contender_config(name: str, role: str, steps: int = 3) -> BenchConfig:
    return BenchConfig(f"{name}:eagle3-s{steps}-k1-n{steps + 1}", SpecParams(f"/{name}", steps, 1, steps + 1),
                       "default", role=role, draft=name)  # fmt: skip


def test_the_new_draft_must_beat_the_incumbent_beyond_the_spread() -> None:
    from tasks.gate.plan import CHALLENGER, INCUMBENT, Incumbent, LeftOut

    inc = Incumbent("run-a-0123456789ab", "/registry/drafts/run-a-0123456789ab", "evidence")
    new, old = spec_config(3), contender_config(INCUMBENT, INCUMBENT)
    # Better than the baseline, worse than the incumbent: rejected, with both numbers.
    result = result_with(BASE, new, old)
    add_launches(result, BASE, [100, 103, 97])
    add_launches(result, new, [150, 152, 149])
    add_launches(result, old, [180, 177, 183])
    d = decide(result, CFG, inc)
    assert d.outcome == "reject" and d.best == new.name and d.ci_low > 1.0  # it does beat the baseline
    assert d.reasons[0].startswith("faster than the baseline beyond the spread")
    assert d.reasons[1].startswith("slower than the incumbent: eagle3-s3-k1-n4 median 150.5 tok/s vs the incumbent "
                                   "run-a-0123456789ab's incumbent:eagle3-s3-k1-n4 180.0 tok/s: margin 0.8")  # fmt: skip
    assert d.incumbent is not None and d.incumbent["beaten"] is False and d.incumbent["ci"][1] < 1.0
    assert [(c.name, c.config) for c in d.contenders] == [("new draft", new.name), ("incumbent", old.name)]
    assert d.contenders[0].vs_incumbent is not None and d.contenders[0].vs_incumbent[0] == d.incumbent["margin"]
    assert d.contenders[1].vs_incumbent is None

    # Inside the spread of the incumbent: still rejected (the CI of the margin includes 1.0).
    result = result_with(BASE, new, old)
    add_launches(result, BASE, [100, 103, 97])
    add_launches(result, new, [150, 170, 160])
    add_launches(result, old, [165, 150, 158])
    d = decide(result, CFG, inc)
    assert d.outcome == "reject" and d.reasons[1].startswith("not faster beyond the spread than the incumbent")
    assert d.reasons[1].endswith("the CI includes 1.0")

    # Better than both: promoted, the margin recorded; a faster challenger is reported, not promoted.
    ch = contender_config("challenger-aq", CHALLENGER, 4)
    result = result_with(BASE, new, old, ch)
    add_launches(result, BASE, [100, 103, 97])
    add_launches(result, new, [180, 177, 183])
    add_launches(result, old, [140, 142, 139])
    add_launches(result, ch, [230, 228, 233])
    left = [LeftOut("challenger-bad", CHALLENGER, "/nowhere", "no draft folder at /nowhere")]
    d = decide(result, CFG, inc, left)
    assert d.outcome == "promote" and d.best == new.name
    assert d.reasons[1].startswith("faster than the incumbent beyond the spread")
    assert d.reasons[2].startswith("a challenger is faster: challenger-aq:eagle3-s4-k1-n5 median 230")
    assert "beyond the spread" in d.reasons[2]
    assert d.incumbent["beaten"] is True and 1.2 < d.incumbent["ci"][0] < d.incumbent["margin"]
    assert d.summary()["left_out"] == [{"name": "challenger-bad", "role": CHALLENGER, "path": "/nowhere",
                                        "reason": "no draft folder at /nowhere"}]  # fmt: skip
    assert [c["name"] for c in d.summary()["contenders"]] == ["new draft", "incumbent", "challenger-aq"]

    # An incumbent that gives no valid measurement: the baseline rule alone, and the decision says so.
    result = result_with(BASE, new, old)
    add_launches(result, BASE, [100, 103, 97])
    add_launches(result, new, [150, 152, 149])
    add_launches(result, old, [300, 300, 300], errors=2)
    d = decide(result, CFG, inc)
    assert d.outcome == "promote" and d.incumbent["not_measured"].startswith("incumbent:eagle3-s3-k1-n4: 6 of 18 requests failed")
    assert d.reasons[1].startswith("the incumbent run-a-0123456789ab gave no valid measurement")


def test_a_divergence_is_judged_by_the_baselines_view_at_its_first_position() -> None:
    near = [(27, -0.70), (11, -0.92), (12, -3.0), (13, -4.0), (14, -5.0)]
    d = diverging(7, 11, near)
    assert (d["cls"], d["position"], d["baseline_token"], d["speculative_token"]) == (NEAR_TIE, 7, 27, 11)
    assert (d["baseline_logprob"], d["speculative_logprob"], d["gap"]) == (-0.70, -0.92, pytest.approx(0.22))
    assert d["top"] == [[t, lp] for t, lp in near] and d["threshold"] == 0.5
    # The re-score (a third path) may rank the speculative token first: still the top two.
    assert diverging(7, 11, [(11, -0.6), (27, -0.8), (12, -3.0), (13, -4.0), (14, -5.0)])["cls"] == NEAR_TIE
    # Three tokens tied to the last bit, the re-score ranking decode's own second and the speculative
    # third (as on the H200, run 9: SmolLM2 at request 5, position 57): both within the threshold of
    # the best, a near-tie.
    three = diverging(7, 12, [(31, -1.272), (27, -1.272), (12, -1.397), (13, -2.772), (14, -3.897)])
    assert (three["cls"], three["best_logprob"], three["gap"]) == (NEAR_TIE, -1.272, pytest.approx(0.125))
    assert three["why"] == "near-tie: both within 0.5 nats of the best, gap 0.125, ranks 2 and 3 of tokens within it"
    # Beyond the threshold; close to each other but one too far below the best; outside the top K
    # (gap bounded by the K-th).
    assert diverging(7, 11, near, threshold=0.2)["why"] == "gap 0.220 nats > 0.2"
    far = diverging(7, 12, [(13, -0.20), (27, -0.75), (12, -0.80), (11, -4.0), (14, -5.0)])
    assert (far["cls"], far["gap"]) == (NOT_LOSSLESS, pytest.approx(0.05))
    assert far["why"] == "the baseline's own token is 0.550 nats below the best there (logprob -0.200) > 0.5 (ranks 2 and 3)"
    outside = diverging(7, 99, near)
    assert (outside["cls"], outside["speculative_logprob"], outside["speculative_below"]) == (NOT_LOSSLESS, None, -5.0)
    assert outside["gap"] == pytest.approx(4.3)
    # Nothing after the first divergence counts, and an equal output has none.
    assert classify(REFERENCE, list(REFERENCE), None, None, evidence(7, near), 0.5) is None
    # One output a strict prefix of the other: the shorter side's stop token is its token there.
    stopped = classify(REFERENCE, REFERENCE[:5], None, 27, evidence(5, [(25, -0.7), (27, -0.9)]), 0.5)
    assert stopped is not None and (stopped.cls, stopped.prefix, stopped.speculative_token) == (NEAR_TIE, "speculative stopped", 27)
    no_stop = classify(REFERENCE, REFERENCE[:5], None, None, evidence(7, near), 0.5)
    assert no_stop is not None and no_stop.cls == NOT_LOSSLESS and "without a stop token" in no_stop.why
    after = classify(REFERENCE, [*REFERENCE, 2], None, None, evidence(7, near), 0.5)  # the reference ended first
    assert after is not None and (after.position, after.baseline_token) == (len(REFERENCE), None) and after.cls == NOT_LOSSLESS
    # No re-score: not evidence of a near-tie.
    blind = classify(REFERENCE, REFERENCE[:7] + [11], None, None, "re-score of prompt 0 failed: HTTP 500", 0.5)
    assert blind is not None and blind.cls == "no_evidence" and blind.why.endswith("HTTP 500")
    # A frequency penalty moves both tokens as decode moved them: token 21 was emitted once before position 7.
    penalized = classify(REFERENCE, REFERENCE[:7] + [21], None, None, evidence(7, [(27, -0.7), (21, -0.6), (12, -3.0)]), 0.5, 1.0)
    assert penalized is not None and penalized.speculative_logprob == pytest.approx(-1.6) and penalized.cls == NOT_LOSSLESS


def test_near_ties_keep_a_faster_config_promotable_and_baseline_noise_is_reported_loudly() -> None:
    spec = spec_config(3)
    near = diverging(7, 11, [(27, -0.70), (11, -0.92), (12, -3.0), (13, -4.0), (14, -5.0)])
    result = result_with(BASE, spec)
    add_launches(result, BASE, [100, 103, 97])
    add_launches(result, spec, [180, 177, 183], exact=False, divergence=near)
    d = decide(result, CFG)
    assert (d.outcome, d.best) == ("promote", spec.name)
    assert d.reasons[0].endswith("outputs lossless: 0 of 18 exact, 18 first leaving the baseline's at a near-tie")
    s = d.config(spec.name)
    assert s.lossless == {"exact": 0, "near_tie": 18, "not_lossless": 0, "no_evidence": 0, "compared": 18}
    assert d.config("baseline").lossless["compared"] == 12  # its first launch is the reference, not a comparison

    noisy = result_with(BASE, spec)
    add_launches(noisy, BASE, [100, 103, 97], exact=False)  # its second and third launches leave the first
    add_launches(noisy, spec, [180, 177, 183])
    d = decide(noisy, CFG)
    assert d.outcome == "promote"  # the speculative outputs are exact; the noise is reported
    assert d.reasons[-1].startswith("WARNING: baseline-vs-baseline is not lossless (baseline: 12 of 12 requests): the "
                                    "threshold (gate.near_tie_nats) or the server is off; first: not lossless: request 0")  # fmt: skip
    from tasks.gate.report import render_markdown

    md = render_markdown(d, noisy, CFG)
    assert "| baseline (vs its first launch) | 12 | 0 | 0 | 12 | 0 |" in md
    assert "**Baseline-vs-baseline is not lossless (baseline): the threshold or the server is off.**" in md


def test_the_verdict_column_cannot_be_read_against_the_decision() -> None:
    """report.md's verdict: the best config of a REJECT is 'best, not promoted', never a bare
    'eligible' beside the REJECT; the promoted one says so."""
    from tasks.gate.report import render_markdown

    spec = spec_config(3)
    for medians, outcome, says in (([101, 99, 104], "reject", "best, not promoted (reject)"), ([180, 177, 183], "promote", "promoted")):
        result = result_with(BASE, spec)
        add_launches(result, BASE, [100, 103, 97])
        add_launches(result, spec, medians)
        d = decide(result, CFG)
        assert (d.outcome, d.best, d.config(spec.name).eligible) == (outcome, spec.name, True)
        md = render_markdown(d, result, CFG)
        row = next(line for line in md.splitlines() if line.startswith(f"| {spec.name} |"))
        assert row.endswith(f"| {says} |") and "eligible" not in row, row
        assert next(line for line in md.splitlines() if line.startswith("| baseline |")).endswith("| reference |")
