"""The device time a session gives its gate and its draft, and where the estimates come from: the
product's (the gate's config as the gate stage loads it, tasks/gate/plan.py's forecast_launches at
the profile's gate.forecast_launch_s and forecast_tok_s, through `node gate-plan`); the largest gate
that ends in the time left (gate_plan.gate_trims); the draft's epochs fitted beside the gate it
prefers; the train stage run with train.time_budget_s; the scaling drafts in as many processes as
the GPU holds."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpunode import generation, node_env, plans, setup, training, travel
from gpunode.gate_plan import gate_trims, preferred
from gpunode.gate_session import GATE_FIXED_S, gate_s
from gpunode.pipeline import Pipeline
from gpunode.session_train import (
    CHECKPOINT_BYTES,
    DRAFT_BF16_BYTES,
    DRAFT_EXPORT_S,
    epochs_need_s,
    train_budget_s,
)
from tests.gpunode_support import QWEN, REPO, on_node, qwen_node

TREE = {"num_steps": 3, "topk": 4, "num_draft_tokens": 8}
RUN_15_TOKENS = {"tokens": {"prompt_done": 1_286_841, "completion_done": 1_856_553}}  # 204 steps an epoch packed


def _left(node: Path, seconds: float) -> None:
    (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + seconds, "budget_s": 1800.0}))


def _forecast_s(pipeline: Pipeline, sets: list[str]) -> tuple[float, object]:
    """A gate's device time as the stage would run it with `sets`: the product's forecast."""
    from tasks.config import load_config
    from tasks.gate.plan import forecast_launches

    cfg = load_config(QWEN, overrides=[*pipeline.sets, *sets])
    return GATE_FIXED_S + forecast_launches(cfg.gate).device_s, cfg


def _qwen_launches(node: Path, plan: str) -> list[str]:
    """The launches the gate of `plan` makes on the Qwen profile, in order (names, scaling drafts
    as the train stage names them)."""

    from tasks.config import load_config
    from tasks.gate.plan import SCALING, ExtraDraft, launch_order, plan_configs

    (node / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(REPO))}))
    (node / "options.json").write_text(json.dumps(plans.plan_options([], plan, None)))
    pipeline = Pipeline()
    assert pipeline.profile == QWEN
    cfg = load_config(pipeline.profile, overrides=pipeline.sets)
    scaling = [ExtraDraft(f"scaling-{n}", f"/s/{n}", cfg.gate.scaling_num_steps, role=SCALING, samples=n)
               for n in ((1024, 3073, 6147) if cfg.train.scaling_fractions else ())]  # fmt: skip
    configs = plan_configs(cfg.gate, "/draft", scaling)
    return [c.name for _, c in launch_order(configs, cfg.gate.repetitions)]


def test_the_qwen_sessions_gate_the_launches_their_device_time_was_sized_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28's gate split over sessions (gpunode/README.md): each qwen plan's
    settings load with the profile the manifest names, and its gate makes exactly the launches its
    session's estimate counts, one server at a time."""
    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    gate = _qwen_launches(tmp_path, "qwen-gate")
    assert sorted(gate) == sorted(["baseline"] * 2 + [f"eagle3-s{k}-k1-n{k + 1}" for k in (1, 2, 3)] * 2
                                  + ["eagle3-s3-k4-n8"] * 2)  # fmt: skip
    # The break-even at num_steps 3 rides with the sweep's 3, 4 and 5 (gate.breakeven_num_steps),
    # after the configs the decision needs: a gate cut short loses the break-even first.
    sweep = _qwen_launches(tmp_path, "qwen-sweep")
    assert sweep[-3:] == [f"eagle3-s3-k1-n4+acc{x}" for x in ("1.5", "2", "2.5")]
    assert sorted(sweep[:-3]) == sorted(["baseline"] * 2 + [f"eagle3-s{k}-k1-n{k + 1}" for k in (3, 4, 5)] * 2)
    scaling = _qwen_launches(tmp_path, "qwen-scaling")
    assert sorted(scaling) == sorted(["baseline"] * 2 + ["eagle3-s3-k1-n4"] * 2
                                     + [f"scaling-{n}:eagle3-s3-k1-n4" for n in (1024, 3073, 6147)])  # fmt: skip
    # The forecast counts exactly these launches, and the policy's pair the profile's load levels add.
    qwen_node(tmp_path, "qwen-gate")
    forecast = Pipeline().gate_plan()["trims"][0]["launches"]
    assert forecast == {"baseline": 2, "candidate": 8, "policy": 2} and sum(forecast.values()) == len(gate) + 2
    from tasks.config import load_config

    profile = load_config(QWEN)
    assert profile.gate.concurrent_servers == 1 and profile.gate.cuda_graph_max_bs >= 1
    # Generation keeps a queue at its server: more in flight than the server runs at once.
    args = generation.generation_server_args("/m")
    assert args[args.index("--max-running-requests") + 1] == "256" == str(generation.SERVER_MAX_RUNNING)
    assert "--disable-radix-cache" in args  # a full KV pool evicting on every admission (P16)
    assert profile.engine.concurrency_per_server > generation.SERVER_MAX_RUNNING


def test_the_decision_gate_shrinks_to_what_ends_in_the_device_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen-gate's gate (the baseline, num_steps 1, 2 and 3, the tree; twice each, and the policy's
    pair): with less device time left, the shorter chains go first, shortest first, then the tree;
    the baseline and num_steps 3 always stay (the least gate that decides). Every estimate is the
    product's forecast of the gate the stage loads with those overrides, at the profile's forecast
    keys; measurements.json says what was left out."""
    from tasks.gate.plan import forecast_launches, launch_order, plan_configs

    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    qwen_node(tmp_path, "qwen-gate")
    pipeline = Pipeline()
    pipeline.write_params()
    assert pipeline.gate_within_budget() == []  # no `node start --budget`: nothing to fit
    trims = [[], ["gate.num_steps=[2, 3]"], ["gate.num_steps=[3]"], ["gate.num_steps=[3]", "gate.topk_points=[]"]]
    seconds = [_forecast_s(pipeline, sets)[0] for sets in trims]
    assert seconds == sorted(seconds, reverse=True)
    for left, sets in [(seconds[0] + 30, trims[0]), (seconds[0] - 30, trims[1]), (seconds[1] - 30, trims[2]),
                       (seconds[2] - 30, trims[3]), (300.0, trims[3])]:  # fmt: skip
        _left(tmp_path, left)
        assert pipeline.gate_within_budget() == sets, left
        # the gate stage loads them, and the forecast counts the launches it makes
        cfg = _forecast_s(pipeline, sets)[1]
        launches = launch_order(plan_configs(cfg.gate, "/draft", []), cfg.gate.repetitions)
        assert forecast_launches(cfg.gate).total == len(launches) + 2  # the policy's pair: load levels
    said = json.loads((tmp_path / "measurements.json").read_text())["gate_trimmed"]
    assert said["whole_gate_s"] == pytest.approx(seconds[0]) and said["gate_s"] == pytest.approx(seconds[3])
    assert said["seconds_left"] < 301 and said["left_out"] == [{"num_steps": 1}, {"num_steps": 2}, TREE]
    plan = pipeline.gate_plan()
    assert (plan["forecast_launch_s"], plan["forecast_tok_s"]) == (85, 440)  # the profile's, not the product's defaults
    # The gate a session that trains its draft plans for keeps the tree: the tree and num_steps 3.
    chosen = plan["trims"][plan["preferred"]]
    assert chosen["num_steps"] == [3] and chosen["topk_points"] == [TREE]


def test_the_sweep_counts_its_break_even_launches_and_shrinks_to_the_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen-sweep's gate: num_steps 3, 4 and 5 with the baseline, twice each, then the break-even's
    three launches at num_steps 3 (acceptance forced), which the forecast counts as the stage runs
    them (a few prompts each); with less time left num_steps 5 goes first, then 4: 3 stays, and
    the break-even stays with the least gate (it is what the session is for)."""
    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    qwen_node(tmp_path, "qwen-sweep")
    pipeline = Pipeline()
    pipeline.write_params()
    trims = [[], ["gate.num_steps=[3, 4]"], ["gate.num_steps=[3]"]]
    seconds = [_forecast_s(pipeline, sets)[0] for sets in trims]
    rows = pipeline.gate_plan()["trims"]
    assert [gate_s(r) for r in rows] == pytest.approx(seconds) and [r["sets"] for r in rows] == trims
    for row in rows:
        assert row["launches"]["breakeven"] == 3 and row["launches"]["baseline"] == 2
        assert row["launches"]["candidate"] == 2 * len(row["num_steps"])
    for left, sets in [(seconds[0] + 30, []), (seconds[0] - 30, trims[1]), (seconds[1] - 30, trims[2])]:
        _left(tmp_path, left)
        assert pipeline.gate_within_budget() == sets, left
    left_out = json.loads((tmp_path / "measurements.json").read_text())["gate_trimmed"]["left_out"]
    assert left_out == [{"num_steps": 4}, {"num_steps": 5}]


def test_a_trimmed_gate_keeps_the_chain_the_goal_and_the_curve_are_measured_at() -> None:
    """gate_trims keeps gate.scaling_num_steps (3) whatever the sweep: the chains farthest from it
    go first, the shorter of two as far, then the topk points; a gate without 3 keeps its longest.
    It reads the GateConfig the product loads."""
    from tasks.config import load_config
    from tasks.config.gate_section import SpecPoint

    gate = load_config(QWEN).gate
    tree = gate.model_copy(update={"num_steps": [3, 4], "topk_points": [SpecPoint(**TREE)]})
    trims = gate_trims(tree)
    assert [sets for sets, _ in trims] == [[], ["gate.num_steps=[3]"], ["gate.num_steps=[3]", "gate.topk_points=[]"]]
    assert trims[-1][1].num_steps == [3] and trims[-1][1].topk_points == [] and preferred(trims) == 1
    steps = [g.num_steps for _, g in gate_trims(gate.model_copy(update={"num_steps": [5, 1, 3, 2, 4], "topk_points": []}))]
    assert steps == [[5, 1, 3, 2, 4], [2, 3, 4, 5], [2, 3, 4], [3, 4], [3]]
    short = gate.model_copy(update={"num_steps": [1, 2], "topk_points": []})
    assert [g.num_steps for _, g in gate_trims(short)] == [[1, 2], [2]]


def test_a_session_that_trains_its_draft_leaves_the_gate_its_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before qwen-gate trains the draft it gates, the epochs are fitted to the device time left:
    the profile's 4 when the draft at the measured pace and the gate it prefers (num_steps 3 and
    the tree, the product's forecast) both fit, fewer when not (params.yaml and the stages' --set
    carry them), the profile's when nothing fits; a restart keeps the first choice, and epochs
    given with --set stand. The draft then trains through the train stage with
    train.time_budget_s: the device time left less what must follow it."""
    import yaml

    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "run/generate").mkdir(parents=True)
    (tmp_path / "run/generate/progress.json").write_text(json.dumps(RUN_15_TOKENS))

    def choose(left: float, sets: list[str] | None = None, plan: str = "qwen-gate",
               **drafts: float) -> tuple[Pipeline, dict | None]:  # fmt: skip
        (tmp_path / "measurements.json").unlink(missing_ok=True)
        qwen_node(tmp_path, plan, sets)
        _left(tmp_path, left)
        pipeline = Pipeline()
        pipeline.write_params()
        pipeline.epochs_within_budget(**drafts)
        said = json.loads((tmp_path / "measurements.json").read_text()).get("train_epochs") if (
            tmp_path / "measurements.json").is_file() else None  # fmt: skip
        return pipeline, said

    def epochs() -> int:
        return yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["epochs"]

    pipeline, said = choose(20_000.0)
    plan = pipeline.gate_plan()
    gate = gate_s(plan["trims"][plan["preferred"]])
    train = pipeline.params_data()["train"]
    need = {e: epochs_need_s(e, said["steps_per_epoch_estimate"], train, 1.0, gate) for e in (1, 2, 3, 4)}
    assert said["epochs"] == 4 and said["fits"] and said["gate_reserve_s"] == pytest.approx(gate)
    assert epochs() == 4 and not any(s.startswith("train.epochs") for s in pipeline.sets)
    pipeline, said = choose(need[4] - 20)
    assert said["epochs"] == 3 and said["profile_epochs"] == 4 and said["needed_s"] == pytest.approx(need[3])
    assert epochs() == 3 and "train.epochs=3" in pipeline.sets
    pipeline, said = choose(need[1] - 20)  # not even one epoch and the gate: the budget stops it at a checkpoint
    assert said["epochs"] == 4 and said["fits"] is False and epochs() == 4
    # A restart keeps what was chosen, whatever is left now: its checkpoints were planned for it.
    (tmp_path / "measurements.json").write_text(json.dumps({"train_epochs": {"epochs": 3, "profile_epochs": 4}}))
    _left(tmp_path, 20_000.0)
    restarted = Pipeline()
    restarted.epochs_within_budget()
    assert epochs() == 3 and "train.epochs=3" in restarted.sets
    pipeline, said = choose(700.0, ["train.epochs=2"])  # given: it stands, nothing decided
    assert said is None and epochs() == 2
    # qwen-scaling without a carried draft: the full draft and its scaling drafts (0.1 + 0.3 + 0.6 of
    # it) side by side, then a gate with each scaling draft once (num_steps 3, no tree).
    pipeline, said = choose(20_000.0, plan="qwen-scaling", drafts=2.0, scaling_drafts=3)
    scaling_gate = gate_s(pipeline.gate_plan(scaling_drafts=3)["trims"][-1])
    assert said["gate_reserve_s"] == pytest.approx(scaling_gate)
    need2 = {e: epochs_need_s(e, said["steps_per_epoch_estimate"], train, 2.0, scaling_gate) for e in (1, 2)}
    pipeline, said = choose(need2[2] - 20, plan="qwen-scaling", drafts=2.0, scaling_drafts=3)
    assert said["epochs"] == 1 and "train.epochs=1" in pipeline.sets
    pipeline, said = choose(need2[2] + 20, plan="qwen-scaling", drafts=2.0, scaling_drafts=3)
    assert said["epochs"] == 2 and epochs() == 2
    _the_draft_trains_within_the_time_left(tmp_path, monkeypatch, choose(need[4] + 100)[0], need[4] + 100)


def _the_draft_trains_within_the_time_left(node: Path, monkeypatch: pytest.MonkeyPatch, pipeline: Pipeline,
                                           left: float) -> None:  # fmt: skip
    """draft_to_gate runs the train stage with train.time_budget_s for the time left; here the stage
    stands in for a draft its budget stopped at step 400 (its record, and the CLI's exit 1)."""
    stages: list[tuple[str, tuple[str, ...]]] = []

    def stopped_train_stage(self: Pipeline, stage: str, *overrides: str, **kw: object) -> None:
        stages.append((stage, overrides))
        self.note(stage, "running", "eaglescale run")
        (node / "run/train").mkdir(parents=True, exist_ok=True)
        (node / "run/train/result.json").write_text(json.dumps({"steps": 400, "stopped_for_budget": True,
                                                                "recipe": {"total_steps": 816}}))  # fmt: skip
        raise RuntimeError("eaglescale run --stages train exited 1 (logs/stage-train.log)")

    monkeypatch.setattr(Pipeline, "stage", stopped_train_stage)
    assert pipeline.draft_to_gate() is False
    ((stage, overrides),) = stages
    assert stage == "train" and len(overrides) == 1 and overrides[0].startswith("train.time_budget_s=")
    assert float(overrides[0].split("=")[1]) == pytest.approx(train_budget_s(left, CHECKPOINT_BYTES), abs=5)
    fit = json.loads((node / "train-fit.json").read_text())
    assert fit["stopped_at_step"] == 400 and fit["finished"] is False and fit["total_steps"] == 816
    assert fit["reserve_s"] == pytest.approx(pipeline.least_gate_s())  # the least gate that decides
    status = json.loads((node / "status.json").read_text())
    assert status["steps"]["train"]["state"] == "stopped" and status["steps"]["gate"]["state"] == "skipped"
    assert "stopped at step 400, whose checkpoint travels" in status["detail"] and "`node start` again" in status["detail"]
    # Started again on the same machine, the draft resumes (the train stage again); one the train
    # stage finished is not trained again.
    stages.clear()
    assert Pipeline().draft_to_gate() is False and len(stages) == 1
    status = json.loads((node / "status.json").read_text())
    status["steps"]["train"]["state"] = "done"
    (node / "status.json").write_text(json.dumps(status))
    stages.clear()
    Pipeline().draft_to_gate()
    assert stages == []


def test_a_forecast_session_leaves_its_scaling_drafts_their_way_back() -> None:
    """Under train.forecast_full_draft a stopped draft's checkpoint travels with every finished
    scaling draft exported beside it: its budget leaves their exports and calls their time."""
    alone, beside = train_budget_s(1800, CHECKPOINT_BYTES), train_budget_s(1800, CHECKPOINT_BYTES, exports=4)
    calls = travel.calls_for(CHECKPOINT_BYTES + 4 * DRAFT_BF16_BYTES) - travel.calls_for(CHECKPOINT_BYTES)
    assert calls >= 4 and alone - beside == pytest.approx(4 * DRAFT_EXPORT_S + calls * travel.SECONDS_PER_CALL)


def test_scaling_drafts_beside_a_carried_draft_train_at_its_epochs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen-scaling with run 18's draft carried (612 steps: 3 epochs of run 15's replies, where the
    profile says 4): the scaling drafts train 3 epochs, read from the carried draft's record, so
    that the curve's points share its recipe; epochs given with --set stand; a draft of 816 steps
    reads as the profile's 4 and changes nothing."""

    import yaml

    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(REPO))}))
    (tmp_path / "run/generate").mkdir(parents=True)
    (tmp_path / "run/generate/progress.json").write_text(json.dumps(
        {"tokens": {"prompt_done": 1_286_841, "completion_done": 1_856_553}}))  # fmt: skip
    (tmp_path / "run/train").mkdir(parents=True)

    def read_as(steps: int, sets: list[str] | None = None) -> tuple[Pipeline, int]:
        (tmp_path / "measurements.json").unlink(missing_ok=True)
        (tmp_path / "run/train/result.json").write_text(json.dumps({"steps": steps, "recipe": {"total_steps": steps}}))
        (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-scaling", None, plans.parse_settings(sets or []))))
        pipeline = Pipeline()
        pipeline.write_params()
        pipeline.epochs_carried()
        return pipeline, yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["epochs"]

    pipeline, epochs = read_as(612)
    assert epochs == 3 and "train.epochs=3" in pipeline.sets
    said = json.loads((tmp_path / "measurements.json").read_text())["train_epochs"]
    assert said["carried_draft_steps"] == 612 and said["profile_epochs"] == 4
    pipeline, epochs = read_as(816)
    assert epochs == 4 and not any(s.startswith("train.epochs") for s in pipeline.sets)
    pipeline, epochs = read_as(612, ["train.epochs=2"])
    assert epochs == 2 and not (tmp_path / "measurements.json").exists()


def test_a_scaling_gate_shrinks_to_one_repetition_and_one_that_would_not_end_is_left_to_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen-scaling's gate (the baseline and the full draft twice, each scaling draft once) runs
    whole when it ends in the device time left, else with one repetition (each point still has
    its launch), else not at all: a gate cut short writes no curve. The skipped gate's step in
    status.json says why and where the packed drafts go next."""
    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    qwen_node(tmp_path, "qwen-scaling")
    (tmp_path / "run/train/scaling").mkdir(parents=True)
    (tmp_path / "run/train/scaling/index.json").write_text(json.dumps({"drafts": [
        {"samples": n, "final": f"train/scaling/frac-{n}/final"} for n in (1024, 3073, 6147)]}))  # fmt: skip
    pipeline = Pipeline()
    pipeline.write_params()
    plan = pipeline.gate_plan(scaling_drafts=3)
    whole, one = gate_s(plan["trims"][0]), gate_s(plan["one_repetition"])
    assert plan["trims"][0]["launches"] == {"baseline": 2, "candidate": 2, "scaling": 3, "policy": 2}
    assert plan["one_repetition"]["launches"] == {"baseline": 1, "candidate": 1, "scaling": 3, "policy": 2}

    def with_left(seconds: float) -> list[str] | None:
        _left(tmp_path, seconds)
        return pipeline.scaling_gate_within_budget()

    assert with_left(whole + 60) == []
    assert with_left(whole - 60) == ["gate.repetitions=1"]
    trimmed = json.loads((tmp_path / "measurements.json").read_text())["gate_trimmed"]
    assert trimmed["gate_s"] == one and trimmed["whole_gate_s"] == whole
    pipeline.note("scaling-pack", "done")
    assert with_left(one - 60) is None
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["steps"]["gate"]["state"] == "skipped" and not pipeline.done_before("gate")
    assert "`node scaling-drafts K`, then `prepare --scaling-from`" in status["detail"]
    skipped = json.loads((tmp_path / "measurements.json").read_text())["gate_skipped"]
    assert skipped["gate_s"] == one and skipped["seconds_left"] < one


def test_a_draft_resumed_from_a_carried_checkpoint_trains_at_its_epochs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint carried in (`prepare --checkpoint-from`) of a draft scheduled for 3 epochs of
    204 steps, where the profile says 4: the node resumes it at 3 epochs, exactly (the trainer
    refuses a resume at other total steps), whatever the device time left would choose; a
    restart keeps that, and epochs given with --set stand."""

    import yaml

    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(REPO))}))
    (tmp_path / "run/generate").mkdir(parents=True)
    (tmp_path / "run/generate/progress.json").write_text(json.dumps(
        {"tokens": {"prompt_done": 1_286_841, "completion_done": 1_856_553}}))  # fmt: skip
    step = tmp_path / "run/train/checkpoints/step-400"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 400, "total_steps": 612, "steps_per_epoch": 204}))
    (tmp_path / "carried.json").write_text(json.dumps({"generation": True, "draft": False, "checkpoint": False}))

    def fitted(sets: list[str] | None = None) -> tuple[Pipeline, int]:
        (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-gate", None, plans.parse_settings(sets or []))))
        # 1,600 s left: a draft trained from its start here would keep the profile's 4 epochs.
        (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 1600, "budget_s": 1800}))
        pipeline = Pipeline()
        pipeline.write_params()
        pipeline.epochs_within_budget()
        return pipeline, yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["epochs"]

    # A checkpoint without its meta.json is no checkpoint (a save cut short): nothing carried.
    assert travel.run_holds(tmp_path / "run")["checkpoint"] is False
    (step / "meta.json").write_text(json.dumps({"step": 400, "sha256": {}}))
    assert travel.run_holds(tmp_path / "run")["checkpoint"] is True
    (tmp_path / "carried.json").write_text(json.dumps(travel.run_holds(tmp_path / "run")))
    pipeline, epochs = fitted()
    said = json.loads((tmp_path / "measurements.json").read_text())["train_epochs"]
    assert epochs == 3 and "train.epochs=3" in pipeline.sets
    assert said["carried_checkpoint"] == "step-400" and said["carried_checkpoint_steps"] == 612 and said["profile_epochs"] == 4
    (step / "trainer_state.json").write_text(json.dumps({"step": 400, "total_steps": 816, "steps_per_epoch": 204}))
    pipeline, epochs = fitted()  # a restart keeps its first reading
    assert epochs == 3
    (tmp_path / "measurements.json").unlink()
    pipeline, epochs = fitted()
    assert epochs == 4 and not any(s.startswith("train.epochs") for s in pipeline.sets)
    (tmp_path / "measurements.json").unlink()
    pipeline, epochs = fitted(["train.epochs=2"])
    assert epochs == 2 and not (tmp_path / "measurements.json").exists()


def test_the_scaling_drafts_train_in_as_many_processes_as_the_gpu_holds_beside_the_full_draft(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three Qwen trainers (the full draft and two scaling processes, ~32 GiB each at their peak)
    fit an H200's 141 GiB and not an H100's 80: there the scaling drafts train in one process
    beside the full draft, and in two where no full draft trains (a carried one). The GPU's size
    comes from nvidia-smi (a stand-in with the real tool's CSV output), measurements.json says
    what was chosen, and each process is started with its fractions."""

    assert training.scaling_groups([0.6, 0.1, 0.3], 1, 140.4, 36.0) == [[0.1, 0.3], [0.6]]
    assert training.scaling_groups([0.6, 0.1, 0.3], 1, 79.6, 36.0) == [[0.1, 0.3, 0.6]]
    assert training.scaling_groups([0.6, 0.1, 0.3], 0, 79.6, 36.0) == [[0.1, 0.3], [0.6]]
    assert training.scaling_groups([0.6, 0.1, 0.3], 1, None, 36.0) == [[0.1, 0.3], [0.6]]  # not known: as before
    assert training.scaling_groups([0.6, 0.1, 0.3], 1, 79.6, None) == [[0.1, 0.3], [0.6]]  # a plan without a size
    assert training.scaling_groups([0.5], 1, 10.0, 36.0) == [[0.5]] and training.scaling_groups([], 1, 80.0, 36.0) == []

    on_node(monkeypatch, tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '81559 MiB'\n")  # an H100 80GB HBM3
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert setup.gpu_memory_gib() == pytest.approx(79.65, abs=0.01)
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(REPO))}))
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-scaling", None)))
    pipeline = Pipeline()
    pipeline.write_params()
    started: list[list[str]] = []
    monkeypatch.setattr(pipeline, "py", lambda args, log, env=None, wait=True: started.append(args[-1]))
    assert list(pipeline.start_scaling({}, beside=1)) == ["scaling-0.1,0.3,0.6"] and started == ["0.1,0.3,0.6"]
    said = json.loads((tmp_path / "measurements.json").read_text())["scaling_processes"]
    assert said["groups"] == [[0.1, 0.3, 0.6]] and said["beside"] == 1 and said["trainer_gib"] == 36.0
    assert list(pipeline.start_scaling({}, beside=0)) == ["scaling-0.1,0.3", "scaling-0.6"]


