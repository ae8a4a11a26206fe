"""The gate stage as the DAG runs it: on a real trained and exported draft of the tiny target,
with the local speculative engine (plain functions) and with the SGLang emulator (the real CLI,
`--stages gate`, Slack at a local receiver, promotion into a registry folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tasks.config import EagleScaleConfig
from tasks.draft import checkpoint as ckpt
from tasks.draft.export import export_to_run
from tasks.draft.scaling_drafts import train_scaling_drafts
from tasks.draft.trainer import train_draft
from tasks.extract.storage import extract_metadata
from tasks.gate.promote import POINTER
from tasks.gate.stage import (
    COSTS_KEY,
    PREDICTION_KEY,
    REPLAY_KEY,
    completed_gate,
    run_gate_once,
    run_gate_stage,
)
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_BEST
from tests.draft_support import extracted_run
from tests.run_support import cli_env, start_cli
from tests.slack_support import Receiver

GATE = {"num_steps": [1, 2], "topk_points": [], "repetitions": 2, "num_prompts": 6, "max_new_tokens": 16,
        "warmup_requests": 1, "acceptance_floor": 1.0, "n_bootstrap": 300, "replay_sequences": 24,
        "cost_iters": 5, "health_timeout_s": 60, "health_poll_s": 0.05, "request_timeout_s": 30}  # fmt: skip
# Emulated speeds (tasks.standins.spec_launch): a fast draft, and one whose cycles cost more
# than the tokens they gain. The decision times requests by the wall clock, HTTP included;
# steps of several ms keep the emulated ~1.8x well clear of what a loaded 2-core machine
# adds per request (tens of ms would otherwise squeeze it into the noise).
FAST = {"prefill_s": 0.004, "baseline_step_s": 0.006, "verify_step_s": 0.007, "draft_step_s": 0.0008,
        "accept_probs": [0.9, 0.85]}  # fmt: skip
SLOW = {**FAST, "verify_step_s": 0.018, "accept_probs": [0.3, 0.2]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> tuple[EagleScaleConfig, Path]:
    """A run with discover, generate, extract committed and a briefly trained, exported draft."""
    base = tmp_path_factory.mktemp("gate-stage")
    config, params = extracted_run(base, tiny_target_dir, base / "template", max_steps=60, eval_every=30, save_every=30)
    run = RunFolder(config.run_root)
    train_draft(run, config.train, config.target.model_path, eval_max_batches=2)
    best = run.read_json(TRAIN_BEST)
    export_to_run(ckpt.load_run_checkpoint_model(run, best["checkpoint"]), run, "train/final")
    return config, params


def _with_gate(config: EagleScaleConfig, run_root: Path, **gate: object) -> EagleScaleConfig:
    data = config.model_dump(mode="json")
    data["run_root"] = str(run_root)
    data["gate"] = {**GATE, **gate}
    return EagleScaleConfig.model_validate(data)


def _copy_run(config: EagleScaleConfig, dest: Path) -> Path:
    import shutil

    shutil.copytree(config.run_root, dest)
    return dest


def test_local_gate_is_lossless_reports_and_keeps_the_previous_draft(trained, tmp_path: Path) -> None:
    config, _ = trained
    run_root = _copy_run(config, tmp_path / "run")
    registry = tmp_path / "registry"
    # min_speedup 100: whatever the CPU measures, this draft cannot be promoted.
    cfg = _with_gate(config, run_root, min_speedup=100.0, registry_url=str(registry))
    run = RunFolder(str(run_root))
    # The train stage's data-scaling draft at half the training sequences (train.scaling_fractions).
    train_scaling_drafts(run, cfg.train.model_copy(update={"scaling_fractions": [0.5]}), cfg.target.model_path,
                         eval_max_batches=2)  # fmt: skip
    outcome = run_gate_stage(cfg, tmp_path / "work")

    assert outcome.summary["outcome"] == "reject" and outcome.summary["promoted"] is False
    assert outcome.summary["previous_draft"] is None and not (registry / POINTER).exists()
    names = [c.name for c in outcome.decision.configs]
    assert names == ["baseline", "eagle3-s1-k1-n2", "eagle3-s2-k1-n3"]
    for c in outcome.decision.configs:
        # Lossless: every speculative output equals the baseline's, token for token.
        assert c.exact_match_fraction == 1.0 and c.n_compared == GATE["repetitions"] * GATE["num_prompts"]
        assert c.n_errors == 0
        if not c.baseline:
            assert 1.0 <= c.accept_length <= c.spec["num_steps"] + 1
    replay = run.read_json(REPLAY_KEY)
    # num_steps 1, 2 and the scaling curve's 3 (gate.scaling_num_steps)
    assert set(replay["overall"]) == {"1", "2", "3"} and replay["overall"]["1"]["sequences"] == 24
    assert set(run.read_json(COSTS_KEY)["verify_s"]) == {"2", "3"}
    prediction = run.read_json(PREDICTION_KEY)
    assert set(prediction["per_steps"]) == {"1", "2"}  # the timed ones
    report = json.loads((run_root / "gate/report.json").read_text())
    assert report["summary"]["outcome"] == "reject"
    # The lossless rule's evidence, as on a server: each baseline pass re-scored every reference
    # (transformers' logits); its second pass is judged against its first.
    rescores = [x["rescore"] for x in report["bench"]["launches"] if x["config"] == "baseline"]
    assert [(r["prompts"], r["errors"]) for r in rescores] == [(GATE["num_prompts"], [])] * GATE["repetitions"]
    assert rescores[1]["max_abs_delta_vs_first"] == 0.0  # the same forward twice
    assert outcome.decision.config("baseline").lossless["exact"] == GATE["num_prompts"]
    assert set(report["predictions"]) == {"baseline", "eagle3-s1-k1-n2", "eagle3-s2-k1-n3"}
    md = (run_root / "gate/report.md").read_text()
    assert "# Gate decision: REJECT" in md and "## Offline replay and cost model" in md
    assert {p.name for p in (run_root / "gate/plots").iterdir()} == {
        "tok_s.png", "acceptance.png", "predicted_vs_measured.png"
    }
    # The data-scaling curve: half the training sequences, then the trained draft itself.
    n_train = extract_metadata(run)["splits"]["train"]
    overall = [p for p in outcome.scaling["points"] if p["domain"] == "all"]
    # The local engine measures no scaling draft: replayed points only.
    assert [(p["samples"], p["kind"]) for p in overall] == [(round(0.5 * n_train), "replay"), (n_train, "replay")]
    # Recorded before the first launch (a gate cut short keeps it), the same figure as the curve's.
    early = json.loads((run_root / "gate/scaling/replay.json").read_text())
    assert list(early) == [str(round(0.5 * n_train))]
    assert early[str(round(0.5 * n_train))]["overall"]["3"]["accept_length"] == overall[0]["accept_length"]
    assert (run_root / "gate/scaling/curve.png").stat().st_size > 1000
    # A resumed run finds this draft decided with these settings; other settings decide anew.
    assert completed_gate(cfg) == outcome.summary
    assert completed_gate(_with_gate(config, run_root, min_speedup=50.0, registry_url=str(registry))) is None
    # Every runner goes through run_gate_once (the flow, the H200 runner's plain fallback): the
    # decided draft is not benchmarked again, nor is the start announced.
    started: list[str] = []
    assert run_gate_once(cfg, on_start=lambda: started.append("started")) == outcome.summary and started == []


def test_a_gate_that_fails_records_where_and_why(trained, tmp_path: Path) -> None:
    config, _ = trained
    run_root = _copy_run(config, tmp_path / "run")
    import shutil

    shutil.rmtree(run_root / "train/final")  # no exported draft to benchmark
    with pytest.raises(FileNotFoundError, match="holds no exported draft"):
        run_gate_stage(_with_gate(config, run_root, registry_url=str(tmp_path / "registry")), tmp_path / "work")
    progress = json.loads((run_root / "gate/progress.json").read_text())
    assert progress["state"] == "failed" and progress["phase"] == "preflight"
    assert "FileNotFoundError" in progress["message"] and "train/final holds no exported draft" in progress["message"]
    assert progress["launches"]["done"] == 0


def _gate_cli(config: EagleScaleConfig, params: Path, tmp_path: Path, run_root: Path, sim: dict, registry: Path,
              slack_url: str) -> tuple[int, str]:  # fmt: skip
    data = yaml.safe_load(params.read_text())
    data["run_root"] = str(run_root)
    data["stages"] = ["gate"]
    data["gate"] = {**GATE, "engine": "emulated", "emulator": sim, "registry_url": str(registry)}
    path = tmp_path / f"params-{len(list(tmp_path.glob('params-*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    log = tmp_path / "cli.log"
    # INFO: the flow's log lines (what the Prefect UI shows) reach the log file too.
    env = cli_env(tmp_path, SLACK_WEBHOOK_URL=f"{slack_url}/services/T000/B000/XXXSECRET", PREFECT_LOGGING_LEVEL="INFO")
    rc = start_cli(["run", "--params", str(path)], env, log).wait(timeout=600)
    return rc, log.read_text()


def test_emulated_gate_promotes_then_keeps_it_when_a_slower_draft_loses(trained, tmp_path: Path) -> None:
    config, params = trained
    run_root = _copy_run(config, tmp_path / "run")
    registry = tmp_path / "registry"
    with Receiver() as slack:
        rc, log = _gate_cli(config, params, tmp_path, run_root, FAST, registry, slack.url)
        assert rc == 0, log[-3000:]
        pointer = json.loads((registry / POINTER).read_text())
        assert pointer["evidence"]["outcome"] == "promote" and pointer["previous"] is None
        published = registry / "drafts" / pointer["draft_id"]
        assert {p.name for p in published.iterdir()} == {"config.json", "model.safetensors"}
        assert json.loads((run_root / POINTER).read_text())["draft_id"] == pointer["draft_id"]
        texts = [json.dumps(r["json"]) for r in slack.requests]
        decision = [t for t in texts if "gate: PROMOTE" in t]
        assert decision and "speedup" in decision[0] and pointer["draft_id"] in decision[0]
        # Where it was, launch by launch: the record, each launch's log tail, a line in the UI.
        progress = json.loads((run_root / "gate/progress.json").read_text())
        launches = 3 * GATE["repetitions"]  # baseline + num_steps 1, 2
        assert progress["state"] == "done" and progress["phase"] == "done" and progress["message"]
        assert progress["launches"] == {"planned": launches, "done": launches, "failed": 0}
        rows = progress["finished"]
        assert [r["launch"] for r in rows] == list(range(launches))
        assert all(r["tok_s"] > 0 and r["requests"] == GATE["num_prompts"] for r in rows)
        assert all(r["health_s"] > 0 and 0 < r["measure_s"] <= r["since_wave_start_s"] for r in rows)
        assert all((r["accept_length"] is None) == (r["config"] == "baseline") for r in rows)
        assert all(1.0 <= r["accept_length"] <= 3.0 for r in rows if r["accept_length"] is not None)
        # per launch as the decision pools its launches: the pooled figure lies between them, per domain too
        configs = {c["name"]: c for c in json.loads((run_root / "gate/report.json").read_text())["decision"]["configs"]}
        for name, c in configs.items():
            mine = [r for r in rows if r["config"] == name]
            assert all(set(r["accept_length_per_domain"]) == set(c["accept_length_per_domain"]) for r in mine)
            for domain, pooled in c["accept_length_per_domain"].items():
                values = [r["accept_length_per_domain"][domain] for r in mine]
                assert min(values) - 1e-9 <= pooled <= max(values) + 1e-9
        assert configs["baseline"]["accept_length_per_domain"] == {} and len(configs) == 3
        assert len(list((run_root / "gate/server-logs").iterdir())) == launches
        assert f"gate: launch {launches}/{launches} " in log and "gate: benchmark: 3 configs x 2 repetitions" in log

        # A second run whose draft loses: rejected, the promoted draft stays the registry's.
        rc, log = _gate_cli(config, params, tmp_path, run_root, SLOW, registry, slack.url)
        assert rc == 0, log[-3000:]
        assert json.loads((registry / POINTER).read_text())["draft_id"] == pointer["draft_id"]
        report = json.loads((run_root / "gate/report.json").read_text())
        assert report["summary"]["outcome"] == "reject"
        texts = [json.dumps(r["json"]) for r in slack.requests]
        rejected = [t for t in texts if "gate: REJECT" in t]
        assert rejected and pointer["draft_id"] in rejected[0]  # "kept: <the promoted draft>"
    assert "XXXSECRET" not in log


def test_the_progress_record_keeps_no_credentials(tmp_path: Path) -> None:
    from tasks.gate.progress import GateProgress
    from tasks.gate.records import LaunchRecord

    progress = GateProgress(RunFolder(str(tmp_path / "run")))
    progress.planned(1)
    record = LaunchRecord("baseline", "default", 0, "", "", error="not healthy: http://user:s3cret@10.0.0.1:30000")
    progress.launch_done(0, record)
    progress.finished("failed", "ServerStartError: http://user:s3cret@10.0.0.1:30000 did not serve")
    text = (tmp_path / "run/gate/progress.json").read_text()
    data = json.loads(text)
    assert "s3cret" not in text and data["launches"] == {"planned": 1, "done": 1, "failed": 1}
    assert data["message"] == "ServerStartError: http://***@10.0.0.1:30000 did not serve"
    assert data["finished"][0]["error"] == "not healthy: http://***@10.0.0.1:30000"


def test_a_launch_keeps_its_server_logs_start_and_end(tmp_path: Path) -> None:
    """Run 17's launches took 57-129 s to be ready and kept only their logs' ends: the start-up
    (arguments, weights, captures, with their clocks) is kept now, beside the end."""
    from tasks.gate.progress import LOG_HEAD_BYTES, LOG_TAIL_BYTES, GateProgress
    from tasks.gate.records import LaunchRecord

    start = b"".join(b"[12:00:%02d] Load weight end. mem usage=3.1 GB\n" % k for k in range(60))
    middle = b"Decode batch, #running-req: 1\n" * 20_000
    end = b"SIGTERM received. Draining requests and shutting down...\n"
    log = tmp_path / "000-baseline-rep0.log"
    log.write_bytes(start + middle + end)
    progress = GateProgress(RunFolder(str(tmp_path / "run")))
    progress.planned(1)
    progress.launch_done(0, LaunchRecord("baseline", "default", 0, "", str(log)))
    kept = (tmp_path / "run/gate/server-logs/000-baseline-rep0.log").read_bytes()
    assert kept.startswith(start) and kept.endswith(end) and start[:LOG_HEAD_BYTES] in kept
    left_out = len(start + middle + end) - LOG_HEAD_BYTES - LOG_TAIL_BYTES
    assert f"[... {left_out} bytes left out ...]".encode() in kept
    assert len(kept) < LOG_HEAD_BYTES + LOG_TAIL_BYTES + 100
    short = tmp_path / "001-baseline-rep1.log"
    short.write_bytes(start + end)  # a log that fits is kept whole
    progress.launch_done(0, LaunchRecord("baseline", "default", 1, "", str(short)))
    assert (tmp_path / "run/gate/server-logs/001-baseline-rep1.log").read_bytes() == start + end


def _emulate(run_root: Path, accept_probs: list[float]) -> None:
    """Give the run's exported draft its emulated acceptance (tasks.sglang.server_process: a draft's
    config.json `eaglescale_emulator`); a new config.json makes it a new draft too."""
    path = run_root / "train/final/config.json"
    data = json.loads(path.read_text())
    data["eaglescale_emulator"] = {"accept_probs": accept_probs}
    path.write_text(json.dumps(data, indent=2))


def test_the_new_draft_must_beat_the_incumbent_and_challengers_are_reported(trained, tmp_path: Path) -> None:
    """Emulated acceptance per draft, chains of 3 (baseline 3 ms/token; a cycle 4.7 ms): the
    incumbent at [0.8, 0.7, 0.6] (~1.7x), a worse new draft at [0.6, 0.5, 0.4] (~1.3x), a better
    one at [0.98, 0.97, 0.96] (~2.4x)."""
    from flows.gate import decision_fields
    from tasks.gate.contenders import same_target

    config, _ = trained
    run_root = _copy_run(config, tmp_path / "run")
    registry = tmp_path / "registry"
    bad = tmp_path / "not-a-draft"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    challengers = [{"name": "missing", "path": str(tmp_path / "nowhere")}, {"name": "plain", "path": str(bad)}]
    sizes = {"engine": "emulated", "emulator": FAST, "num_steps": [3], "max_new_tokens": 48, "registry_url": str(registry)}
    cfg = _with_gate(config, run_root, **sizes, challengers=challengers)
    run = RunFolder(str(run_root))

    # No incumbent: today's rule. The challengers that cannot be measured are reported and left out.
    _emulate(run_root, [0.8, 0.7, 0.6])
    first = run_gate_stage(cfg, tmp_path / "work-1")
    assert first.summary["promoted"] is True and first.decision.incumbent is None
    pointer = json.loads((registry / POINTER).read_text())
    incumbent_id = pointer["draft_id"]
    assert pointer["replaced"] is None and pointer["evidence"]["best_spec"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}
    assert same_target(pointer["target"], run.read_json("run.json")["fingerprint"]["target"])
    left = {x["name"]: x["reason"] for x in first.summary["left_out"]}
    assert left["challenger-missing"] == f"gate.challengers missing ({tmp_path}/nowhere): no draft folder at {tmp_path}/nowhere"
    assert left["challenger-plain"].startswith(f"gate.challengers plain ({bad}): preflight of {bad} failed")
    assert "no model.safetensors" in left["challenger-plain"]
    assert [c.name for c in first.decision.configs] == ["baseline", "eagle3-s3-k1-n4"]

    # Better than the baseline, worse than the incumbent: rejected; the registry keeps the incumbent.
    # A challenger (the incumbent's files, at its acceptance) is faster: reported, never promoted.
    cfg = _with_gate(config, run_root, **sizes,
                     challengers=[{"name": "aq", "path": str(registry / "drafts" / incumbent_id), "num_steps": 3}])  # fmt: skip
    _emulate(run_root, [0.6, 0.5, 0.4])
    second = run_gate_stage(cfg, tmp_path / "work-2")
    d = second.decision
    assert [c.name for c in d.configs] == ["baseline", "eagle3-s3-k1-n4", "incumbent:eagle3-s3-k1-n4",
                                           "challenger-aq:eagle3-s3-k1-n4"]  # fmt: skip
    assert second.summary["promoted"] is False and d.best == "eagle3-s3-k1-n4" and d.ci_low > 1.0  # beats the baseline
    assert d.incumbent["draft_id"] == incumbent_id and d.incumbent["num_steps_from"] == "evidence"
    assert d.incumbent["beaten"] is False and d.incumbent["ci"][1] < 1.0
    assert any(r.startswith("slower than the incumbent: eagle3-s3-k1-n4") for r in d.reasons)
    assert any(r.startswith("a challenger is faster: challenger-aq:eagle3-s3-k1-n4") for r in d.reasons)
    assert json.loads((registry / POINTER).read_text())["draft_id"] == incumbent_id
    md = (run_root / "gate/report.md").read_text()
    assert f"Incumbent: `{incumbent_id}`" in md and "measured at its promotion's best config" in md
    rows = {c.name: c for c in d.contenders}
    assert set(rows) == {"new draft", "incumbent", "challenger-aq"}
    assert rows["new draft"].vs_incumbent[2] < 1.0 and rows["incumbent"].vs_incumbent is None
    for c in rows.values():  # side by side: each with its speed, acceptance and agreement
        assert c.median_tok_s and c.ci_low and c.accept_length > 1.0 and c.exact_match_fraction == 1.0
        assert len(c.accept_per_position or []) == 3
        assert f"| {c.name} ({c.role}) | {c.config} | {c.median_tok_s:.1f} |" in md
    fields = decision_fields(second.summary)
    assert fields["vs incumbent"].startswith(f"{incumbent_id} (incumbent:eagle3-s3-k1-n4): 0.")
    assert fields["contenders"].startswith("new draft eagle3-s3-k1-n4: ") and fields["kept"] == incumbent_id
    assert "; incumbent:eagle3-s3-k1-n4: " in fields["contenders"] and "; challenger-aq:eagle3-s3-k1-n4: " in fields["contenders"]

    # Better than both: it replaces the incumbent; the history records both promotions.
    _emulate(run_root, [0.98, 0.97, 0.96])
    third = run_gate_stage(cfg, tmp_path / "work-3")
    assert third.summary["promoted"] is True, third.summary["message"]
    pointer = json.loads((registry / POINTER).read_text())
    assert pointer["draft_id"] == third.summary["draft_id"] != incumbent_id
    assert pointer["previous"]["draft_id"] == incumbent_id
    replaced = pointer["replaced"]
    assert replaced["draft_id"] == incumbent_id and replaced["margin"] > replaced["ci"][0] > 1.0
    history = sorted(json.loads(p.read_text())["draft_id"] for p in (registry / "history").iterdir())
    assert history == sorted([incumbent_id, pointer["draft_id"]])


def test_a_draft_promoted_by_hand_is_the_next_gates_incumbent(trained, tmp_path: Path, capsys) -> None:
    """`eaglescale promote`: refused without a registry or an export, naming what is missing;
    otherwise published with the reason, and a later gate measures it over the sweep (the
    record names no best config) and keeps it when the new draft is slower."""
    from flows.cli import main

    config, params = trained
    registry = tmp_path / "registry"
    first_root = _copy_run(config, tmp_path / "first")
    data = yaml.safe_load(params.read_text())
    data["run_root"] = str(first_root)
    data["gate"] = {**GATE, "engine": "emulated", "emulator": FAST, "num_steps": [2, 3], "max_new_tokens": 48}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    reason = "no draft beats the baseline on this target yet: the 1k-sample draft is the one to beat"

    assert main(["promote", "--params", str(path), "--reason", reason]) == 1
    assert "gate.registry_url is not set" in capsys.readouterr().err
    args = ["promote", "--params", str(path), "--set", f"gate.registry_url={registry}", "--reason", reason]
    assert main([*args[:3], "--run-root", str(tmp_path / "empty"), *args[3:]]) == 1
    assert f"{tmp_path}/empty/train/final: no exported draft" in capsys.readouterr().err
    assert not registry.exists()  # nothing published by a refused promotion

    _emulate(first_root, [0.8, 0.7, 0.6])
    assert main(args) == 0
    pointer = json.loads((registry / POINTER).read_text())
    assert capsys.readouterr().out.startswith(f"promoted {pointer['draft_id']} by hand to {registry}/drafts/")
    assert pointer["evidence"] == {"by_hand": True, "reason": reason, "gate": None, "best_spec": None}
    assert pointer["target"] == RunFolder(str(first_root)).read_json("run.json")["fingerprint"]["target"]
    assert pointer["previous"] is None and pointer["replaced"] is None
    assert {p.name for p in (registry / "drafts" / pointer["draft_id"]).iterdir()} == {"config.json", "model.safetensors"}

    second_root = _copy_run(config, tmp_path / "second")
    _emulate(second_root, [0.6, 0.5, 0.4])
    cfg = _with_gate(config, second_root, engine="emulated", emulator=FAST, num_steps=[2, 3], max_new_tokens=48,
                     registry_url=str(registry))  # fmt: skip
    d = run_gate_stage(cfg, tmp_path / "work").decision
    assert [c.name for c in d.configs] == ["baseline", "eagle3-s2-k1-n3", "eagle3-s3-k1-n4",
                                           "incumbent:eagle3-s2-k1-n3", "incumbent:eagle3-s3-k1-n4"]  # fmt: skip
    assert d.incumbent["draft_id"] == pointer["draft_id"]
    assert d.incumbent["num_steps_from"] == "sweep (its evidence names no best config)"
    assert d.promote is False and any(r.startswith("slower than the incumbent: ") for r in d.reasons)
    assert json.loads((registry / POINTER).read_text())["draft_id"] == pointer["draft_id"]
    md = (second_root / "gate/report.md").read_text()
    assert "measured over the gate's sweep (its evidence names no best config)." in md


def test_a_promotion_by_hand_checks_the_draft_at_every_config_of_the_sweep(trained, tmp_path: Path) -> None:
    """The topk points too, where a later gate measures an incumbent that names no best config.
    Checked at the chain configs alone, a sweep of topk points left no config to check the
    algorithm at, and a topk point SGLang refuses was never resolved: both were published."""
    from tasks.gate.promote import PromotionError
    from tasks.gate.promote_by_hand import promote_by_hand

    config, _ = trained
    root = _copy_run(config, tmp_path / "run")
    registry = tmp_path / "registry"
    final = root / "train/final/config.json"
    exported = json.loads(final.read_text())
    final.write_text(json.dumps({**exported, "architectures": ["LlamaForCausalLM"]}))
    topk_only = _with_gate(config, root, engine="emulated", num_steps=[], registry_url=str(registry),
                           topk_points=[{"num_steps": 3, "topk": 4, "num_draft_tokens": 8}])  # fmt: skip
    with pytest.raises(PromotionError, match=r"EAGLE3 needs an EAGLE-3 draft, but its architectures are \['LlamaForCausalLM'\]"):
        promote_by_hand(topk_only, "a rollback")

    final.write_text(json.dumps(exported))
    no_draft_tokens = _with_gate(config, root, engine="emulated", num_steps=[2], registry_url=str(registry),
                                 topk_points=[{"num_steps": 3, "topk": 4}])  # fmt: skip
    with pytest.raises(PromotionError, match="--speculative-num-draft-tokens must be set with --speculative-eagle-topk 4"):
        promote_by_hand(no_draft_tokens, "a rollback")
    assert not registry.exists()  # nothing published by a refused promotion
