"""The gate at load, end to end on the SGLang emulator (real processes, real HTTP): a draft that wins
at concurrency 1 and loses at 16 (a batch cost model: every token a forward processes costs time),
the per-level decision, where it stops paying, the serving policy that turns speculation off at 16,
its own launch (which holds with the policy and fails without it), the plain policy of a tree, the
report, the registry record and `eaglescale serving-policy`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flows.cli import main
from tasks.config.gate_section import GateConfig, SpecPoint
from tasks.gate.benchmark import GateRunner
from tasks.gate.decision import decide
from tasks.gate.load import load_record
from tasks.gate.plan import POLICY_CONFIG, forecast_launches, plan_configs
from tasks.gate.promote import promote
from tasks.gate.prompts import load_bench_prompts
from tasks.gate.records import BenchResult
from tasks.gate.report import REPORT_MD, write_gate_report
from tasks.gate.serving_policy import (
    ADAPTIVE,
    ROUTER,
    build_policy,
    judge,
    policy_launches,
    write_policy,
)
from tasks.gate.stage import LOAD_KEY, decide_server
from tasks.runfolder import RunFolder
from tasks.sglang.adaptive import AdaptiveConfig
from tasks.sglang.server_process import EmulatedLauncher
from tests.gate_support import commit_holdout, encode, write_draft

# A 3-step chain accepting ~3.3 tokens a cycle. Each token a target forward processes adds 1.5 ms
# and each draft step 0.3 ms per request: per token at batch 1 the baseline takes 7.5 ms and the
# chain ~4.5 (~1.7x); at 2, 4.5 and ~3.3 (~1.4x); at 16, 1.9 and ~2.3 (~0.8x). Steps of several
# ms keep the emulator's timing well above a loaded box's scheduling noise.
LOADED = {"prefill_s": 0.002, "baseline_step_s": 0.006, "verify_step_s": 0.006, "draft_step_s": 0.0006,
          "batch_token_s": 0.0015, "draft_batch_token_s": 0.0003, "accept_probs": [0.9, 0.85, 0.8]}  # fmt: skip
# A lighter batch cost: the 3-step chain ~2.2x at 1, ~1.9x at 2 and ~1.07x at 16, where the 1-step
# chain (a verify of 2 tokens a request) is ~1.1x: speculation pays at every level, by the most at
# 3 steps alone and at 1 step (or 3) among 16.
MILD = {**LOADED, "batch_token_s": 0.0003, "draft_batch_token_s": 0.0001}
LEVELS = [1, 2, 16]


def gate_cfg(**overrides: Any) -> GateConfig:
    base = dict(engine="emulated", sglang_version="0.5.14", num_steps=[3], topk_points=[], repetitions=2,
                num_prompts=4, max_new_tokens=16, warmup_requests=1, acceptance_floor=1.1, health_timeout_s=30,
                health_poll_s=0.05, request_timeout_s=60, n_bootstrap=500, concurrency=LEVELS,
                cuda_graph_max_bs=16)  # fmt: skip
    return GateConfig(**{**base, **overrides})


@pytest.fixture
def run(tmp_path: Path) -> RunFolder:
    folder = RunFolder(str(tmp_path / "run"))
    commit_holdout(folder)
    return folder


def sweep(tmp_path: Path, run: RunFolder, cfg: GateConfig, sim: dict[str, Any] = LOADED) -> tuple[GateRunner, BenchResult, Path]:
    draft = write_draft(tmp_path / "draft")
    prompts = load_bench_prompts(run, cfg.num_prompts, cfg.prompt_seed, encode)
    runner = GateRunner(cfg, EmulatedLauncher(cfg.sglang_version, sim), "/models/target",
                        plan_configs(cfg, str(draft)), prompts, tmp_path / "logs")  # fmt: skip
    return runner, runner.run(), draft


def test_the_gate_measures_every_level_and_ships_a_policy_that_holds(tmp_path: Path, run: RunFolder) -> None:
    """Speculation pays at every level: the adaptive policy speculates everywhere, at the steps
    that pay most at each level, and holds on its own launch pair."""
    cfg = gate_cfg(num_steps=[1, 3], registry_url=str(tmp_path / "registry"))
    runner, result, draft = sweep(tmp_path, run, cfg, MILD)
    decision, policy = decide_server(cfg, runner, result, draft, tmp_path)
    chain = decision.config("eagle3-s3-k1-n4")
    assert chain is not None and set(chain.levels) == {"1", "2", "16"}
    # Every level's requests: all prompts at 1, at least 3 per slot and 24 in all above (2 launches).
    assert [chain.levels[c].n_requests for c in ("1", "2", "16")] == [8, 48, 96]
    assert chain.levels["1"].wins() and chain.levels["2"].wins() and not chain.levels["16"].loses()
    base = decision.config("baseline")
    assert base is not None and base.levels["16"].throughput_tok_s > 2.5 * base.levels["1"].throughput_tok_s
    assert policy is not None and policy.kind == ADAPTIVE and policy.holds, decision.reasons
    tiers = AdaptiveConfig.parse(policy.adaptive_config).tiers
    assert tiers[1] == (3,) and all(steps[0] > 0 for steps in tiers.values())  # never a tier of 0 steps
    assert policy.num_steps == 3 and policy.max_running_requests == 16
    assert policy.vllm is not None and policy.vllm["num_speculative_tokens_per_batch_size"][0][:2] == [1, 2]
    own = decision.config(POLICY_CONFIG)
    assert own is not None and own.eligible and all(own.levels[c].wins() for c in ("1", "2"))
    assert not own.levels["16"].loses() and policy.verified is not None and set(policy.verified) == {"1", "2", "16"}
    assert decision.outcome == "promote" and decision.policy is not None
    assert any(r.startswith("the adaptive policy held on its own launch at every level") for r in decision.reasons)
    # Every launch the gate's own forecast said (the dry run prints it), the policy's pair included.
    assert forecast_launches(cfg).total == len(result.launches) == 8
    # Its launch: the adaptive flags and the running-request cap raised to the highest level.
    policy_launch = next(x for x in result.launches if x.config == POLICY_CONFIG)
    assert policy_launch.max_running_requests == 16
    assert "speculative_adaptive=True" in Path(policy_launch.log_path).read_text()
    # What a reader sees, and what ships.
    write_policy(run, decision)
    report = write_gate_report(run, decision, result, cfg)
    assert "gate/plots/load.png" in report["plots"]
    md = run.read_bytes(REPORT_MD).decode()
    assert "## At load" in md and "| eagle3-s3-k1-n4 | " in md and "## Serving policy" in md
    assert "Kind: **adaptive**; holds." in md
    assert run.read_json("gate/sglang-adaptive.json") == policy.adaptive_config
    run.write_json_atomic(LOAD_KEY, load_record(result, decision.configs, {1: 1.8, 3: 3.2}, 16.0, cfg.deploy_level))
    assert set(run.read_json(LOAD_KEY)["prediction"]) == {"1", "2", "16"}
    summary = promote(run, decision, str(draft), cfg.registry_url)
    assert summary["promoted"] and summary["serving_policy"]["kind"] == ADAPTIVE


def test_a_draft_that_loses_at_16_ships_behind_a_router_split(tmp_path: Path, run: RunFolder) -> None:
    """Wins at 1 and 2, slower beyond the spread at 16: one speculative server cannot hold at 16
    (a tier of 0 steps still runs the speculative pipeline, slower than a plain server), so the
    policy is speculative servers up to 2 and plain servers above, from the sweep's figures."""
    cfg = gate_cfg()
    runner, result, draft = sweep(tmp_path, run, cfg)
    decision, policy = decide_server(cfg, runner, result, draft, tmp_path)
    chain = decision.config("eagle3-s3-k1-n4")
    assert chain is not None and chain.levels["1"].wins() and chain.levels["2"].wins() and chain.levels["16"].loses()
    assert chain.crossover is not None and chain.crossover["pays_up_to"] == 2 and 2 < chain.crossover["crossover"] < 16
    assert policy is not None and policy.kind == ROUTER and policy.on_up_to == 2 and policy.holds
    assert not any(x.config == POLICY_CONFIG for x in result.launches)  # nothing for one server to verify
    assert "every chain is slower than the baseline beyond the spread at concurrency 16" in policy.reasons[0]
    assert "speculative servers (eagle3-s3-k1-n4) up to concurrency 2, plain servers from concurrency 16" in decision.reasons[-1]
    assert decision.outcome == "promote"
    # Deployed at 16, the router's split leaves nothing to gain: rejected.
    at16 = gate_cfg(deploy_concurrency=16)
    decision16 = decide(result, at16)
    judge(decision16, at16, build_policy(decision16, at16))
    assert decision16.outcome == "reject" and decision16.policy is not None


def test_a_tier_of_0_steps_fails_its_own_launch(tmp_path: Path, run: RunFolder) -> None:
    """The policy the issue first drew (speculation off from 3 requests on, one server) measured:
    its own launch is slower than the baseline beyond the spread at 16, so it does not hold and
    the draft ships behind the router split instead."""
    cfg = gate_cfg()
    runner, result, draft = sweep(tmp_path, run, cfg)
    decision = decide(result, cfg)
    policy = build_policy(decision, cfg)
    assert policy is not None and decision.promote
    policy.kind, policy.num_steps, policy.adaptive_config = ADAPTIVE, 3, {"1": {"candidate_steps": [3]}, "3": {"candidate_steps": [0]}}
    runner.run_more(policy_launches(policy, cfg, str(draft), tmp_path), result)
    decision = decide(result, cfg)
    own = decision.config(POLICY_CONFIG)
    assert own is not None and own.levels["16"].loses() and own.levels["1"].wins()
    log = Path(next(x for x in result.launches if x.config == POLICY_CONFIG).log_path).read_text()
    assert "Switch adaptive runtime state: steps 3 -> 0" in log
    judged = judge(decision, cfg, policy)
    assert judged is not None and judged.kind == ROUTER and judged.on_up_to == 2 and judged.holds
    assert decision.reasons[-2].startswith("the adaptive policy did not hold on its own launch: ")
    assert "concurrency 16" in decision.reasons[-2] and "slower than the baseline beyond the spread" in decision.reasons[-2]
    assert decision.outcome == "promote"


def test_eaglescale_serving_policy_prints_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    registry = RunFolder(str(tmp_path / "registry"))
    policy = {"kind": ADAPTIVE, "levels": [{"level": 1, "num_steps": 3, "config": "eagle3-s3-k1-n4", "speedup": 1.4,
                                           "ci": [1.3, 1.5]}, {"level": 16, "num_steps": 0}],
              "num_steps": 3, "topk": 1, "num_draft_tokens": None,
              "adaptive_config": {"1": {"candidate_steps": [3]}, "2": {"candidate_steps": [0]}},
              "max_running_requests": 16, "on_up_to": None, "config": None,
              "vllm": {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 16, 0]]},
              "verified": None, "holds": True, "reasons": ["held"], "alternatives": []}  # fmt: skip
    registry.write_json_atomic("promoted.json", {"uri": "/reg/drafts/d1", "evidence": {"serving_policy": policy}})
    out_file = tmp_path / "adaptive.json"
    assert main(["serving-policy", "--registry", registry.url, "--write-config", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "adaptive policy (holds): speculates at 1: 3 steps; off at 16" in out
    assert ("--speculative-draft-model-path /reg/drafts/d1 --speculative-num-steps 3 --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens 4 --speculative-adaptive --speculative-adaptive-config {out_file} "
            "--max-running-requests 16") in out  # fmt: skip
    assert json.loads(out_file.read_text()) == policy["adaptive_config"]
    assert '"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 16, 0]]' in out
    assert main(["serving-policy", "--run-root", str(tmp_path / "nowhere")]) == 2


def test_a_tree_gets_the_plain_policy(tmp_path: Path, run: RunFolder) -> None:
    cfg = gate_cfg(num_steps=[], topk_points=[SpecPoint(num_steps=3, topk=4, num_draft_tokens=8)], repetitions=2,
                   concurrency=[1, 16])  # fmt: skip
    runner, result, draft = sweep(tmp_path, run, cfg)
    decision, policy = decide_server(cfg, runner, result, draft, tmp_path)
    assert not any(x.config == POLICY_CONFIG for x in result.launches)  # no adaptive launch for a tree
    assert policy is not None and policy.kind == ROUTER and policy.topk == 4 and policy.on_up_to == 1
    assert policy.launch_flags("/d")[-2:] == ["--speculative-num-draft-tokens", "8"]
    assert decision.outcome == "promote" and decision.policy is not None and decision.policy["holds"]
