"""The gate end to end against the SGLang emulator: real processes, real HTTP, SGLang's flags,
meta_info fields and log lines; fresh launches per repetition."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

from tasks.config.gate_section import GateConfig, SpecPoint
from tasks.gate.benchmark import STUCK_DIAGNOSIS, GateRunner
from tasks.gate.decision import GateDecision, decide
from tasks.gate.plan import launch_order, plan_configs
from tasks.gate.prompts import load_bench_prompts, select_prompts
from tasks.gate.records import BenchResult
from tasks.runfolder import RunFolder
from tasks.sglang.server_process import EmulatedLauncher, ServerStartError
from tasks.sglang.simulated_acceptance import SIMULATE_ACC_LEN
from tasks.standins.sim import launch_speed_factor
from tests.gate_support import (
    AUX_IDS,
    TARGET_CONFIG,
    commit_holdout,
    emulated_speedup,
    encode,
    write_draft,
)

FAST = {"prefill_s": 0.002, "baseline_step_s": 0.003, "verify_step_s": 0.0035, "draft_step_s": 0.0004,
        "accept_probs": [0.9, 0.85, 0.8, 0.7]}  # fmt: skip
# One-step chain at acceptance 0.5: 1.5 tokens per (0.5 + 4.0) ms = the baseline's 3 ms per token.
EVEN = {**FAST, "verify_step_s": 0.004, "draft_step_s": 0.0005, "accept_probs": [0.5]}


def gate_cfg(**overrides: Any) -> GateConfig:
    base = dict(num_steps=[3], topk_points=[], repetitions=2, num_prompts=4, max_new_tokens=24,
                warmup_requests=1, acceptance_floor=1.1, health_timeout_s=30, health_poll_s=0.05,
                request_timeout_s=30, n_bootstrap=500)  # fmt: skip
    return GateConfig(**{**base, **overrides})


@pytest.fixture
def run(tmp_path: Path) -> RunFolder:
    folder = RunFolder(str(tmp_path / "run"))
    commit_holdout(folder)
    return folder


def gate_and_promote(tmp_path: Path, run: RunFolder, cfg: GateConfig, sim: dict[str, Any], draft: Path,
                     predictions: dict[str, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """What run_gate_stage does after replay, on a synthetic draft: preflight, fresh emulated
    launches, decide, report, promote; returns promote's summary."""
    from tasks.gate.preflight import preflight_sweep
    from tasks.gate.promote import promote
    from tasks.gate.report import write_gate_report

    configs = plan_configs(cfg, str(draft))
    preflight_sweep(str(draft), [c.spec for c in configs if c.spec is not None], TARGET_CONFIG, AUX_IDS)
    prompts = load_bench_prompts(run, cfg.num_prompts, cfg.prompt_seed, encode)
    launcher = EmulatedLauncher(cfg.sglang_version, sim)
    result = GateRunner(cfg, launcher, "/models/target", configs, prompts, tmp_path / "logs").run()
    decision = decide(result, cfg)
    write_gate_report(run, decision, result, cfg, predictions)
    return promote(run, decision, str(draft), cfg.registry_url)


def bench(tmp_path: Path, run: RunFolder, cfg: GateConfig, sim: dict[str, Any]) -> tuple[BenchResult, GateDecision]:
    prompts = load_bench_prompts(run, cfg.num_prompts, cfg.prompt_seed, encode)
    configs = plan_configs(cfg, str(tmp_path / "draft"))
    launcher = EmulatedLauncher(cfg.sglang_version, sim)
    result = GateRunner(cfg, launcher, "/models/target", configs, prompts, tmp_path / "logs").run()
    return result, decide(result, cfg)


def test_prompts_are_a_seeded_round_robin_over_domains(run: RunFolder) -> None:
    table = pa.Table.from_pylist(list(reversed(load_table(run))))
    a = select_prompts(table, 4, seed=0, encode=encode)
    b = load_bench_prompts(run, 4, 0, encode)
    assert [p.prompt_id for p in a] == [p.prompt_id for p in b]  # row order does not matter
    assert [p.domain for p in a] == ["chat", "code", "chat", "code"]
    assert [p.index for p in a] == [0, 1, 2, 3]
    assert a[0].input_ids == tuple(encode([{"role": "user", "content": f"chat question number {a[0].prompt_id[-1]}: "
                                                                     "explain something in a few words"}]))  # fmt: skip
    c = select_prompts(table, 6, seed=1, encode=encode)
    assert sorted(p.prompt_id for p in c) == sorted(r["prompt_id"] for r in load_table(run))


def load_table(run: RunFolder) -> list[dict[str, Any]]:
    from tasks.discover.commit import read_prompts_table

    return read_prompts_table(run, "holdout").to_pylist()


def test_launch_order_alternates_baseline_and_speculative() -> None:
    cfg = gate_cfg(num_steps=[1, 2], topk_points=[SpecPoint(num_steps=3, topk=4, num_draft_tokens=8)],
                   repetitions=3, nccl_env_sweep=[{}, {"NCCL_ALGO": "Tree"}])  # fmt: skip
    configs = plan_configs(cfg, "/d")
    assert [c.name for c in configs] == [
        "baseline@env0", "eagle3-s1-k1-n2@env0", "eagle3-s2-k1-n3@env0", "eagle3-s3-k4-n8@env0",
        "baseline@env1", "eagle3-s1-k1-n2@env1", "eagle3-s2-k1-n3@env1", "eagle3-s3-k4-n8@env1",
    ]  # fmt: skip
    assert configs[1].notes == ("num_draft_tokens set to num_steps + 1 = 2 (topk=1 chain)",)
    assert configs[5].env == {"NCCL_ALGO": "Tree"} and configs[4].env == configs[5].env
    order = [(rep, c.name.split("@")[0]) for rep, c in launch_order(configs, 3) if c.env_name == "env0"]
    assert order == [
        (0, "baseline"), (0, "eagle3-s1-k1-n2"), (0, "eagle3-s2-k1-n3"), (0, "eagle3-s3-k4-n8"),
        (1, "eagle3-s1-k1-n2"), (1, "eagle3-s3-k4-n8"), (1, "eagle3-s2-k1-n3"), (1, "baseline"),
        (2, "baseline"), (2, "eagle3-s3-k4-n8"), (2, "eagle3-s1-k1-n2"), (2, "eagle3-s2-k1-n3"),
    ]  # fmt: skip


def test_break_even_launches_come_last_and_run_where_breakeven_num_steps_says() -> None:
    """Break-even launches follow every launch the decision reads (a gate cut short loses them
    first), and gate.breakeven_num_steps runs them at a num_steps the sweep does not measure."""
    cfg = gate_cfg(engine="emulated", num_steps=[4, 5], breakeven_accept_lengths=[1.5, 2.0, 4.5])
    order = [(rep, c.name) for rep, c in launch_order(plan_configs(cfg, "/d"), cfg.repetitions)]
    assert order[6:] == [(0, f"eagle3-s{k}-k1-n{k + 1}+acc{x}") for k in (4, 5) for x in ("1.5", "2", "4.5")]
    assert [name for _, name in order[:6]] == ["baseline", "eagle3-s4-k1-n5", "eagle3-s5-k1-n6",
                                                "eagle3-s4-k1-n5", "eagle3-s5-k1-n6", "baseline"]  # fmt: skip
    at3 = gate_cfg(engine="emulated", num_steps=[4, 5], breakeven_accept_lengths=[1.5, 4.5], breakeven_num_steps=[3])
    forced = [c for c in plan_configs(at3, "/d") if c.role == "breakeven"]
    # 4.5 tokens a verify is past what 3 steps can accept (SGLang clamps it): left out.
    assert [(c.name, c.spec.num_steps, c.env[SIMULATE_ACC_LEN]) for c in forced] == [("eagle3-s3-k1-n4+acc1.5", 3, "1.5")]
    with pytest.raises(ValueError, match="breakeven_num_steps"):
        gate_cfg(engine="emulated", breakeven_accept_lengths=[2.0], breakeven_num_steps=[0])


def test_a_faster_speculative_config_is_promoted(tmp_path: Path, run: RunFolder) -> None:
    draft = write_draft(tmp_path / "draft")
    cfg = gate_cfg(topk_points=[SpecPoint(num_steps=3, topk=2, num_draft_tokens=6)], env={"HF_TOKEN": "hf-secret-1"},
                   nccl_env_sweep=[{"NCCL_ALGO": "Ring"}], registry_url=str(tmp_path / "registry"))  # fmt: skip
    summary = gate_and_promote(tmp_path, run, cfg, FAST, draft, {"baseline": 300.0, "eagle3-s3-k1-n4": 600.0})
    assert summary["outcome"] == "promote" and summary["promoted"] is True
    # Wall clock (the decision's) only says faster; the emulator's own latencies say how much.
    assert summary["speedup"] > 1.0 and summary["ci"][0] > 1.0
    assert summary["best_config"] in {"eagle3-s3-k1-n4", "eagle3-s3-k2-n6"}
    assert json.loads((tmp_path / "registry/promoted.json").read_text())["draft_id"] == summary["draft_id"]

    text = Path(run.path("gate/report.json")).read_text()
    assert "hf-secret-1" not in text
    report = json.loads(text)
    assert report["gate_config"]["env"] == {"HF_TOKEN": "[redacted]"}
    launches = report["bench"]["launches"]
    assert [(x["repetition"], x["config"]) for x in launches] == [
        (0, "baseline"), (0, "eagle3-s3-k1-n4"), (0, "eagle3-s3-k2-n6"),
        (1, "eagle3-s3-k1-n4"), (1, "eagle3-s3-k2-n6"), (1, "baseline"),
    ]  # fmt: skip
    assert {json.dumps(x["server_info"]["eaglescale_env"]) for x in launches} == {'{"NCCL_ALGO": "Ring"}'}
    assert all(x["graph_problems"] == [] and x["info_problems"] == [] for x in launches)
    assert all(x["log"]["captures"]["target"] == {"begin": 1, "end": 1} for x in launches)
    # One flush before the measured requests, and two per cost probe (prefill, then the whole).
    assert all(x["log"]["decode_lines"] > 0 and x["log"]["cache_flushes"] == 1 + 2 * cfg.warmup_requests for x in launches)
    assert all(len(x["probes"]) == 2 * cfg.warmup_requests and x["prefill_s"] > 0 and x["step_s"] > 0 for x in launches)
    assert emulated_speedup(launches, summary["best_config"]) > 1.5
    requests = [r for x in launches for r in x["requests"]]
    assert len(requests) == 6 * 4
    spec = [r for r in requests if r["config"] != "baseline"]
    assert all(r["exact_match"] and r["finish"] in ("stop", "length") for r in requests)
    assert all(r["spec_verify_ct"] > 0 and r["accept_length"] > 1.5 and r["correct_drafts_histogram"] for r in spec)
    assert all(r["spec_verify_ct"] is None for r in requests if r["config"] == "baseline")
    # Lossless by equality: nothing diverged; each baseline launch re-scored every reference.
    assert all(r["divergence"] is None for r in requests)
    assert [r["reference"] for r in requests if r["config"] == "baseline"] == [True] * 4 + [False] * 4
    rescores = [x["rescore"] for x in launches if x["config"] == "baseline"]
    assert [(r["prompts"], r["errors"], r["argmax_flips"]) for r in rescores] == [(4, [], 0)] * 2
    assert rescores[0]["max_abs_delta_vs_first"] is None and rescores[1]["max_abs_delta_vs_first"] == 0.0
    configs = {c["name"]: c for c in report["decision"]["configs"]}
    assert len(configs["eagle3-s3-k1-n4"]["accept_per_position"]) == 3
    assert configs["eagle3-s3-k1-n4"]["lossless"] == {"exact": 8, "near_tie": 0, "not_lossless": 0, "no_evidence": 0,
                                                      "compared": 8}  # fmt: skip
    md = Path(run.path("gate/report.md")).read_text()
    assert md.startswith("# Gate decision: PROMOTE") and "| eagle3-s3-k2-n6 | default |" in md
    for name in ("tok_s", "acceptance", "predicted_vs_measured"):
        assert Path(run.path(f"gate/plots/{name}.png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_slower_config_is_rejected_and_nothing_is_promoted(tmp_path: Path, run: RunFolder) -> None:
    draft = write_draft(tmp_path / "draft")
    slow = {**FAST, "verify_step_s": 0.012, "accept_probs": [0.5, 0.4, 0.3]}
    cfg = gate_cfg(registry_url=str(tmp_path / "registry"))
    summary = gate_and_promote(tmp_path, run, cfg, slow, draft)
    assert (summary["outcome"], summary["promoted"]) == ("reject", False)
    assert summary["reasons"][0].startswith("slower than the baseline: eagle3-s3-k1-n4")
    assert summary["ci"][1] < 1.0
    assert summary["message"].startswith("reject: kept the previous draft (none promoted yet): slower")
    assert not (tmp_path / "registry/promoted.json").exists() and not run.exists("promoted.json")
    assert Path(run.path("gate/report.md")).read_text().startswith("# Gate decision: REJECT")


def test_a_config_inside_the_noise_is_rejected(tmp_path: Path, run: RunFolder) -> None:
    """Equal true speed and a large per-launch spread; 0.5.4's older server (no histograms)."""
    jitter = 0.3
    # Launch order: baseline, spec, spec, baseline. Pick a seed whose emulated speed factors put
    # the spec launches between the baseline ones, i.e. the spread straddles no change.
    seed = next(
        s for s in range(500)
        if (f := [launch_speed_factor(s, i, jitter) for i in range(4)])
        and min(f[0], f[3]) < 0.85 * min(f[1], f[2]) and max(f[0], f[3]) > 1.15 * max(f[1], f[2])
    )  # fmt: skip
    cfg = gate_cfg(num_steps=[1], sglang_version="0.5.4")
    result, d = bench(tmp_path, run, cfg, {**EVEN, "launch_jitter": jitter, "seed": seed})
    assert result.stopped is None and len(result.launches) == 4
    assert d.outcome == "reject"
    assert d.ci_low is not None and d.ci_low <= 1.0 < d.ci_high
    assert d.reasons[0].startswith("within the run-to-run spread: eagle3-s1-k1-n2")
    base = d.config("baseline")
    assert base is not None and base.spread is not None and base.spread > 0.2
    spec = d.config("eagle3-s1-k1-n2")
    assert spec is not None and spec.accept_per_position is None and spec.accept_length > 1.2
    assert all(x.graph_problems == [] for x in result.launches)  # num_steps 1: no draft graph needed


def test_disagreeing_outputs_are_rejected(tmp_path: Path, run: RunFolder) -> None:
    """A server that changes output: random tokens from token 3 on, outside the baseline's top 5."""
    result, d = bench(tmp_path, run, gate_cfg(), {**FAST, "disagree_from": 3})
    assert d.outcome == "reject" and d.best is None
    assert d.reasons[0] == "no speculative config is eligible"
    assert re.fullmatch(r"eagle3-s3-k1-n4: not lossless: request 0 \(prompt chat-\d+, repetition 0\), position 3: "
                        r"baseline token \d+ \(logprob -\d\.\d{3}\) vs speculative \d+ \(logprob < -\d+\.\d{3}, not in "
                        r"the top 5\), gap at least \d+\.\d{3} nats > 0\.625 \(and 7 more requests not lossless\)", d.reasons[1])  # fmt: skip
    spec = [r for r in result.records("eagle3-s3-k1-n4")]
    assert all(r.divergence["cls"] == "not_lossless" and r.divergence["gap"] > 3.0 for r in spec)
    assert d.reasons[2].startswith("fastest measured (not eligible): faster than the baseline beyond the spread: eagle3-s3-k1-n4")
    spec = d.config("eagle3-s3-k1-n4")
    assert spec is not None and spec.speedup is not None and spec.speedup > 1.0  # fast, but wrong
    assert emulated_speedup(result.to_dict()["launches"], "eagle3-s3-k1-n4") > 1.5


def test_acceptance_stuck_at_one_stops_the_run(tmp_path: Path, run: RunFolder) -> None:
    result, d = bench(tmp_path, run, gate_cfg(repetitions=3), {**FAST, "stuck_acceptance": True})
    assert result.stopped is not None and result.stopped.startswith(STUCK_DIAGNOSIS)
    assert result.stopped == f"{STUCK_DIAGNOSIS} (eagle3-s3-k1-n4: accept length 1.00 after warm-up)"
    assert [x.config for x in result.launches] == ["baseline", "eagle3-s3-k1-n4"]  # nothing after
    assert result.launches[1].requests == []
    assert (d.outcome, d.reasons) == ("stopped", [result.stopped])
    with pytest.raises(httpx.ConnectError):  # the stopped launch's server is gone
        httpx.get(result.launches[1].url + "/health", timeout=2, trust_env=False)


def test_a_server_that_never_becomes_healthy_fails_with_its_log_tail(tmp_path: Path, run: RunFolder) -> None:
    cfg = gate_cfg(health_timeout_s=1.0)
    with pytest.raises(ServerStartError) as err:
        bench(tmp_path, run, cfg, {**FAST, "never_healthy": True})
    message = str(err.value)
    assert "not healthy after 1 s (/health_generate: HTTP 503)" in message
    tail = message.split("log tail")[1]
    assert "Capture target decode CUDA graph begin. backend=full" in tail  # where it hung
    assert "CUDA graph end" not in tail
    url = message.split("SGLang server ")[1].split(" ")[0]
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2, trust_env=False)


def test_preflight_refuses_a_draft_of_other_aux_layers(tmp_path: Path, run: RunFolder) -> None:
    from tasks.gate.preflight import PreflightError, preflight_sweep

    draft = write_draft(tmp_path / "draft")
    cfg = gate_cfg()
    specs = [c.spec for c in plan_configs(cfg, str(draft)) if c.spec is not None]
    with pytest.raises(PreflightError, match=r"differ from the extraction's aux layer ids \[2, 4, 5\]"):
        preflight_sweep(str(draft), specs, TARGET_CONFIG, [2, 4, 5])


def test_concurrent_servers_start_in_waves_and_are_measured_one_at_a_time(tmp_path: Path, run: RunFolder) -> None:
    """gate.concurrent_servers: every server of a wave serves before the first of it is
    measured; measurements never overlap; the protocol order and the decision are unchanged."""
    cfg = gate_cfg(num_steps=[1, 3], concurrent_servers=4, mem_fraction_static=0.05)
    result, d = bench(tmp_path, run, cfg, FAST)
    order = [(x.repetition, x.config) for x in result.launches]
    assert order == [(rep, c.name) for rep, c in launch_order(plan_configs(cfg, "/d"), cfg.repetitions)]
    assert len(result.launches) == 6  # a wave of 4, then one of 2
    for wave in (result.launches[:4], result.launches[4:]):
        first_measured = min(x.measured_at for x in wave)
        assert all(x.started_at < first_measured for x in wave)
    spans = [(x.measured_at, x.measured_at + sum(r.latency_s for r in x.requests)) for x in result.launches]
    assert all(a[1] <= b[0] + 0.05 for a, b in zip(spans, spans[1:], strict=False))
    assert d.outcome == "promote"
    # each server of a wave was launched with its own HTTP and NCCL ports (server_args in its log)
    ports = [re.search(r"port=(\d+), tp_size.*nccl_port=(\d+)", Path(x.log_path).read_text()) for x in result.launches]
    assert all(ports) and len({p for m in ports if m for p in m.groups()}) == 2 * len(result.launches)


def test_a_speculative_config_that_cannot_start_is_reported_and_the_rest_go_on(tmp_path: Path, run: RunFolder) -> None:
    cfg = gate_cfg(topk_points=[SpecPoint(num_steps=3, topk=4, num_draft_tokens=8)], concurrent_servers=6,
                   mem_fraction_static=0.05)  # fmt: skip
    result, d = bench(tmp_path, run, cfg, {**FAST, "max_topk": 1})
    tree = [x for x in result.launches if x.config == "eagle3-s3-k4-n8"]
    assert len(tree) == 2 and all("exited with code 1" in (x.error or "") for x in tree)
    assert all(x.requests == [] for x in tree)
    s = d.config("eagle3-s3-k4-n8")
    assert s is not None and not s.eligible and "exited with code 1" in s.reasons[0]
    assert d.outcome == "promote" and d.best == "eagle3-s3-k1-n4"


def test_challenger_and_scaling_drafts_are_measured_beside_and_never_promoted(tmp_path: Path, run: RunFolder) -> None:
    from tasks.gate.plan import CHALLENGER, SCALING, ExtraDraft

    cfg = gate_cfg(repetitions=2, acceptance_floor=1.5)
    extra = [ExtraDraft("challenger-public", "/drafts/public", 3),
             ExtraDraft("scaling-100", "/drafts/s100", 3, role=SCALING, samples=100)]  # fmt: skip
    prompts = load_bench_prompts(run, cfg.num_prompts, cfg.prompt_seed, encode)
    configs = plan_configs(cfg, str(tmp_path / "draft"), extra)
    assert [(c.name, c.role, c.repetitions) for c in configs] == [
        ("baseline", "candidate", None), ("eagle3-s3-k1-n4", "candidate", None),
        ("challenger-public:eagle3-s3-k1-n4", CHALLENGER, None), ("scaling-100:eagle3-s3-k1-n4", SCALING, 1),
    ]  # fmt: skip
    # Emulated acceptance below the floor: the candidate alone would stop the gate; a challenger
    # or scaling draft is only measured. The scaling draft runs in repetition 0 only.
    runner = GateRunner(cfg, EmulatedLauncher(cfg.sglang_version, FAST), "/m", configs[:1] + configs[2:], prompts,
                        tmp_path / "logs")  # fmt: skip
    result = runner.run()
    assert result.stopped is None
    assert [x.config for x in result.launches].count("scaling-100:eagle3-s3-k1-n4") == 1
    d = decide(result, cfg)
    ref = d.config("challenger-public:eagle3-s3-k1-n4")
    assert ref is not None and ref.role == CHALLENGER and ref.speedup is not None and ref.speedup > 1.0
    assert emulated_speedup(result.to_dict()["launches"], "challenger-public:eagle3-s3-k1-n4") > 1.3
    assert d.best is None and d.outcome == "reject"  # only the candidate can be promoted
    scaling = d.config("scaling-100:eagle3-s3-k1-n4")
    assert scaling is not None and scaling.samples == 100 and set(scaling.accept_length_per_domain) == {"chat", "code"}


def test_cost_probes_recover_the_servers_step_costs_and_predict_its_speed(tmp_path: Path, run: RunFolder) -> None:
    """The probes time a server's prefill, decode step and verify cycles apart from the measured
    requests; with the emulator's expected acceptance the prediction lands on the measured speed."""
    from tasks.gate.cost_model import costs_from_launches, predict

    sim = {**FAST, "min_new_fraction": 1.0}  # every completion runs to max_new_tokens
    cfg = gate_cfg(num_steps=[1, 3], max_new_tokens=64, warmup_requests=2)
    result, d = bench(tmp_path, run, cfg, sim)
    costs = costs_from_launches(result)
    # Time to the first token as the client sees it: the prefill plus the HTTP round trip.
    assert FAST["prefill_s"] <= costs.prefill_s < FAST["prefill_s"] + 0.03
    assert costs.baseline_step_s == pytest.approx(FAST["baseline_step_s"], rel=0.15)
    for k in (1, 3):
        cycle = FAST["verify_step_s"] + k * FAST["draft_step_s"]
        assert costs.cycle_s[k] == pytest.approx(cycle, rel=0.15)
    probs = FAST["accept_probs"]
    expected = {k: 1 + sum(math.prod(probs[: j + 1]) for j in range(k)) for k in (1, 3)}
    prediction = predict(costs, expected, tokens_per_request=64)
    for k in (1, 3):
        measured = d.config(f"eagle3-s{k}-k1-n{k + 1}").median_tok_s
        assert prediction.per_steps[k]["tok_s"] == pytest.approx(measured, rel=0.10)
    assert prediction.baseline_tok_s == pytest.approx(d.config("baseline").median_tok_s, rel=0.10)


def test_near_tie_flips_stay_promotable_and_the_break_even_is_measured_on_the_server(tmp_path: Path, run: RunFolder) -> None:
    """A speculative server that flips the target's near-ties (as a bf16 verify does) is lossless
    and promoted; break-even launches (SGLANG_SIMULATE_ACC_LEN) trace the server's own curve,
    whose crossing is the emulator's cycle / baseline step."""
    from tasks.gate.report import write_gate_report

    # Three times FAST's step costs: a 3 ms step is within the sleep and scheduling jitter of a loaded
    # 2-core box (the crossing once went unmeasured there); a 9 ms one is not.
    slow = {k: 3 * v for k, v in FAST.items() if k.endswith("_s")}
    sim = {**FAST, **slow, "near_tie_rate": 0.3, "near_tie_flip_rate": 1.0, "min_new_fraction": 1.0}
    cfg = gate_cfg(engine="emulated", max_new_tokens=48, breakeven_accept_lengths=[1.0, 2.0, 3.0], breakeven_prompts=3)
    result, d = bench(tmp_path, run, cfg, sim)
    assert d.outcome == "promote" and d.best == "eagle3-s3-k1-n4"
    s = d.config("eagle3-s3-k1-n4")
    assert s.eligible and s.lossless["near_tie"] == 8 and s.lossless["not_lossless"] == 0
    divs = [r.divergence for r in result.records(s.name)]
    assert all(x["cls"] == "near_tie" and 0.02 <= x["gap"] <= 0.3 and x["speculative_token"] == x["top"][1][0] for x in divs)
    # Flipped at the same tokens in both launches, as on the H200.
    assert [x["position"] for x in divs[:4]] == [x["position"] for x in divs[4:]]
    base = d.config("baseline")
    assert base.lossless == {"exact": 4, "near_tie": 0, "not_lossless": 0, "no_evidence": 0, "compared": 4}

    forced = [c for c in d.configs if c.role == "breakeven"]
    assert [c.name for c in forced] == [f"eagle3-s3-k1-n4+acc{x}" for x in (1, 2, 3)]
    assert all(not c.eligible and c.reasons[-1].startswith("simulated acceptance") and c.n_requests == 3 for c in forced)
    be = d.breakeven["per_steps"]["3"]
    points = [p["accept_length"] for p in be["points"]]
    assert points == sorted(points) and 1.0 <= points[0] < 1.6 < points[-1] <= 4.0
    # Decode tok/s is X / cycle at a fixed cycle: it crosses the baseline's 1 / step at cycle / step.
    # Both rates are wall-clock request times less a probe-timed first token: within 15% each on a
    # loaded 2-core box, as the cost-probe test finds step costs.
    cycle = slow["verify_step_s"] + 3 * slow["draft_step_s"]
    assert be["break_even"] == pytest.approx(cycle / slow["baseline_step_s"], rel=0.15)
    assert be["model_break_even"] == pytest.approx(cycle / slow["baseline_step_s"], rel=0.15)
    assert be["statement"].startswith(f"this server needs {be['break_even']:.2f} tokens per verify at num_steps 3 to "
                                      f"break even; the draft reached {s.accept_length:.2f}; the cost model predicted")  # fmt: skip

    write_gate_report(run, d, result, cfg)
    md = Path(run.path("gate/report.md")).read_text()
    assert "| eagle3-s3-k1-n4 | 8 | 0 | 8 | 0 | 0 |" in md and "| baseline (vs its first launch) | 4 | 4 | 0 | 0 | 0 |" in md
    assert "## Break-even on this server (measured)" in md and f"- {be['statement']}." in md
    assert Path(run.path("gate/plots/breakeven.png")).read_bytes()[:4] == b"\x89PNG"


def test_a_server_that_emits_a_confident_runner_up_is_not_lossless(tmp_path: Path, run: RunFolder) -> None:
    cfg = gate_cfg(num_prompts=2, max_new_tokens=16)
    result, d = bench(tmp_path, run, cfg, {**FAST, "near_tie_rate": 0.0, "wrong_token_from": 4})
    assert d.outcome == "reject" and d.best is None
    div = result.records("eagle3-s3-k1-n4")[0].divergence
    assert div["position"] == 4 and div["speculative_token"] == div["top"][1][0] and 3.0 <= div["gap"] <= 8.0
    assert d.reasons[1] == (
        f"eagle3-s3-k1-n4: not lossless: request 0 (prompt {result.prompts[0].prompt_id}, repetition 0), position 4: "
        f"baseline token {div['baseline_token']} (logprob {div['baseline_logprob']:.3f}) vs speculative "
        f"{div['speculative_token']} (logprob {div['speculative_logprob']:.3f}), gap {div['gap']:.3f} nats > 0.625 "
        "(and 3 more requests not lossless)"
    )


def test_a_refused_divergence_carries_the_speculative_path_s_own_view(tmp_path: Path, run: RunFolder) -> None:
    """gate.verify_logprobs: each refused request is sent again, untimed, with return_logprob; its
    verify path's logprobs go beside the verdict. A near-tie flip (refused here only because the
    threshold is set below its gap) shows the server's own forward putting its token first by a
    hair, and both paths agreeing on every token before it; a server that emits a confident
    runner-up shows its own forward ranking that token below the baseline's. Neither view
    changes a verdict."""
    from tasks.gate.report import write_gate_report
    from tasks.standins.sim_logprobs import FLIP_LEAD

    def report(cfg: GateConfig) -> str:
        write_gate_report(run, d, result, cfg)
        return Path(run.path("gate/report.md")).read_text()

    sim = {**FAST, "near_tie_rate": 0.3, "near_tie_flip_rate": 1.0, "min_new_fraction": 1.0}
    cfg = gate_cfg(engine="emulated", max_new_tokens=48, near_tie_nats=0.01)
    result, d = bench(tmp_path / "a", run, cfg, sim)
    s = d.config("eagle3-s3-k1-n4")
    assert not s.eligible and s.lossless["not_lossless"] == 8
    for x in [r.divergence for r in result.records(s.name)]:
        v = x["verify"]
        assert v["reproduced"] and v["positions"] == x["position"] and v["prefix_drift_max"] == 0.0
        assert v["own_top"][:2] == [[x["speculative_token"], pytest.approx(x["baseline_logprob"])],
                                    [x["baseline_token"], pytest.approx(x["baseline_logprob"] - v["own_gap"])]]  # fmt: skip
        assert 0.0 <= v["own_gap"] < FLIP_LEAD and not v["own_gap_is_bound"]
        assert v["rescore_gap"] == pytest.approx(x["gap"]) and v["disagreement"] == pytest.approx(x["gap"] + v["own_gap"])
    assert not any(r.divergence for r in result.records("baseline"))  # a baseline is never sent again
    first = result.records(s.name)[0]
    assert (f"- eagle3-s3-k1-n4 request {first.prompt_index} rep 0, position {first.divergence['position']}: its own "
            f"forward put token {first.divergence['speculative_token']} first by {first.divergence['verify']['own_gap']:.3f} "
            f"nats, so the paths disagree there by") in report(cfg)  # fmt: skip

    cfg = gate_cfg(num_prompts=2, max_new_tokens=16)
    result, d = bench(tmp_path / "c", run, cfg, {**FAST, "near_tie_rate": 0.0, "wrong_token_from": 4})
    x = result.records("eagle3-s3-k1-n4")[0].divergence
    v = x["verify"]
    assert v["reproduced"] and v["positions"] == 4 and v["prefix_drift_max"] == 0.0
    assert v["own_gap"] == pytest.approx(-x["gap"]) and v["disagreement"] == pytest.approx(0.0, abs=1e-9)
    assert "yet emitted it: a change of output, not numerics; the two paths differ by at most 0.000 nats" in report(cfg)

    # The default sends again only what the rule refused: near-tie flips are left alone; "off" sends nothing.
    result, d = bench(tmp_path / "d", run, gate_cfg(engine="emulated", max_new_tokens=48), sim)
    assert d.config(s.name).lossless["near_tie"] == 8
    assert all("verify" not in r.divergence for r in result.records(s.name))
    result, _ = bench(tmp_path / "b", run, gate_cfg(num_prompts=2, max_new_tokens=16, verify_logprobs="off"),
                      {**FAST, "near_tie_rate": 0.0, "wrong_token_from": 4})  # fmt: skip
    assert result.records("eagle3-s3-k1-n4")[0].divergence["cls"] == "not_lossless"
    assert all("verify" not in r.divergence for r in result.records("eagle3-s3-k1-n4"))


def test_a_frequency_penalty_under_speculation_is_not_lossless(tmp_path: Path, run: RunFolder) -> None:
    """SGLang applies penalties in a relaxed way under speculative decoding; the emulator does
    too (it repeats a token decode penalized). The same gate without the penalty promotes."""
    cfg = gate_cfg(engine="emulated", num_prompts=2, max_new_tokens=16, frequency_penalty=0.5)
    result, d = bench(tmp_path, run, cfg, FAST)
    assert d.outcome == "reject" and d.best is None
    assert d.config("baseline").lossless["exact"] == 2  # the baseline is its own self at the penalty
    assert d.reasons[1].startswith("eagle3-s3-k1-n4: not lossless: request 0") and "(frequency penalty 0.5 applied)" in d.reasons[1]
    div = result.records("eagle3-s3-k1-n4")[0].divergence
    assert div["penalty"] == 0.5 and div["cls"] == "not_lossless" and div["gap"] > 3.0
