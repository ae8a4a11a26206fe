"""benchmarks/h200_run.py's pipeline process runs on the node's own Python, which has no
pydantic (only the processes it starts get the bundle's site folder): the fourth real run died
when the pipeline itself loaded the profile through tasks.config. Its code imports nothing of
eaglescale's or pydantic's, read from the source, except under `if EXTRA_SETS:` (a CPU
rehearsal, which runs in the project's venv).

Its helper processes train as the train stage does (tasks/train/stage.py): the plain fallback
once dropped the online target for the scaling drafts, and `node scaling` the run's
storage_options; both are run here on the tiny target."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "benchmarks/h200_run.py"
NODE_ONLY = ("tasks", "flows", "pydantic", "prefect", "torch", "transformers")


def _pipeline_class() -> ast.ClassDef:
    tree = ast.parse(RUNNER.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")


def _rehearsal_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "EXTRA_SETS":
            return True
    return False


def test_the_pipeline_process_needs_only_the_node_image() -> None:
    cls = _pipeline_class()
    parents = {child: parent for parent in ast.walk(cls) for child in ast.iter_child_nodes(parent)}
    found = []
    for node in ast.walk(cls):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_config":
            names = ["tasks.config (through _config)"]
        for name in names:
            if name.split(".")[0] in NODE_ONLY and not _rehearsal_only(node, parents):
                found.append(f"line {node.lineno}: {name}")
    assert found == []
    # The reader sees the imports the pipeline does make (a check that cannot pass vacuously).
    assert any(isinstance(n, ast.Import) and n.names[0].name == "yaml" for n in ast.walk(cls))


def test_skip_leaves_the_scaling_drafts_out_of_every_stage_and_the_helpers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node start --skip scaling --skip anchor` (run 5): the stages get the override, and the
    helper processes' params.yaml has no scaling fractions (read with yaml, as the node does)."""
    import json
    import sys

    import yaml

    sys.path.insert(0, str(RUNNER.parents[1]))
    from benchmarks import h200_run

    monkeypatch.setattr(h200_run, "NODE", tmp_path)
    monkeypatch.setattr(h200_run, "EXTRA_SETS", [])
    plain = h200_run.Pipeline()
    registry = f"gate.registry_url={tmp_path / 'registry'}"  # every stage promotes into the node's registry
    assert plain.skip == [] and plain.sets == [registry]
    (tmp_path / "options.json").write_text(json.dumps({"skip": ["scaling", "anchor"]}))
    pipeline = h200_run.Pipeline()
    assert pipeline.sets == ["train.scaling_fractions=[]", registry]
    pipeline.write_params()
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert params["train"]["scaling_fractions"] == []
    assert yaml.safe_load(h200_run.PROFILE.read_text())["train"]["scaling_fractions"]  # the profile keeps its own


def test_skip_sweep_leaves_the_gate_num_steps_3_alone_and_the_profile_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node start --skip sweep` (run 7): the gate decides on num_steps 3 alone, the scaling
    curve's config, and the profile with those overrides validates (a bad override would only
    show on the node, after generation and training)."""
    import json
    import sys

    sys.path.insert(0, str(RUNNER.parents[1]))
    from benchmarks import h200_run
    from tasks.config import load_config

    monkeypatch.setattr(h200_run, "NODE", tmp_path)
    monkeypatch.setattr(h200_run, "EXTRA_SETS", [])
    (tmp_path / "options.json").write_text(json.dumps({"skip": ["sweep", "anchor"]}))
    pipeline = h200_run.Pipeline()
    assert sorted(pipeline.sets) == ["gate.num_steps=[3]", f"gate.registry_url={tmp_path / 'registry'}", "gate.topk_points=[]"]
    gate = load_config(h200_run.PROFILE, overrides=pipeline.sets).gate
    assert gate.num_steps == [3] and gate.topk_points == [] and gate.scaling_num_steps == 3
    assert load_config(h200_run.PROFILE).gate.num_steps == [1, 2, 3, 4, 5]  # the profile keeps its own


def test_the_online_incumbent_plan_leaves_out_what_it_does_not_measure_and_its_stages_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node start --plan online-incumbent` (run 8): no scaling drafts, no SpecForge, no sweep;
    the profile with the overrides its stages add (online hidden states, the 1k-sample run)
    validates here rather than on the node after generation."""
    import json
    import sys

    sys.path.insert(0, str(RUNNER.parents[1]))
    from benchmarks import h200_run
    from tasks.config import load_config

    monkeypatch.setattr(h200_run, "NODE", tmp_path)
    monkeypatch.setattr(h200_run, "EXTRA_SETS", [])
    (tmp_path / "options.json").write_text(json.dumps({"skip": h200_run.PLANS["online-incumbent"], "plan": "online-incumbent"}))
    pipeline = h200_run.Pipeline()
    assert pipeline.plan == "online-incumbent"
    assert sorted(pipeline.skip) == ["anchor", "scaling", "sweep"]
    online = load_config(h200_run.PROFILE, overrides=[*pipeline.sets, "train.hidden_states=online"])
    small = load_config(h200_run.PROFILE, overrides=[*pipeline.sets, f"train.max_train_sequences={h200_run.SMALL_RUN_SEQUENCES}"])
    assert online.train.hidden_states == "online" and online.train.scaling_fractions == []
    assert small.train.max_train_sequences == 1004 and small.gate.num_steps == [3]
    assert online.gate.registry_url == small.gate.registry_url == str(tmp_path / "registry")


def _runner(monkeypatch: pytest.MonkeyPatch, node: Path):  # noqa: ANN202 - the benchmark module
    import sys

    sys.path.insert(0, str(RUNNER.parents[1]))
    from benchmarks import h200_run

    monkeypatch.setattr(h200_run, "NODE", node)  # its helpers read NODE/params.yaml
    return h200_run


SMALL_TRAIN = {"max_steps": 4, "eval_every": 4, "save_every": 4, "scaling_fractions": [0.5]}


def test_the_plain_train_fallback_trains_the_scaling_drafts_online_too(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node plain train` on an online run (nothing extracted): the draft, its scaling draft
    and the export, every one of them on states the trainer makes itself."""
    from tasks.draft.scaling_drafts import scaling_drafts
    from tasks.runfolder import RunFolder
    from tasks.runfolder.layout import TRAIN_FINAL
    from tests.draft_support import extracted_run

    cfg, _ = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path,
                           hidden_states="online", **SMALL_TRAIN)  # fmt: skip
    run = RunFolder(cfg.run_root)
    run.remove("extract", recursive=True)  # the copied template holds extract shards: online must not need them
    assert _runner(monkeypatch, tmp_path).node_plain("train", []) == 0
    assert not run.exists("extract")
    (draft,) = scaling_drafts(run)
    assert run.read_json(f"train/scaling/frac-{draft['samples']}/data.json")["hidden_states"] == "online"
    assert run.exists(f"{draft['final']}/config.json") and run.exists(f"{TRAIN_FINAL}/config.json")


def test_node_scaling_trains_on_the_run_s_own_store(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node scaling` on a run root in S3 (moto): the scaling draft reaches the store through the
    run's storage_options (its endpoint), like every other stage's writes."""
    import yaml

    from tasks.draft.scaling_drafts import scaling_drafts
    from tasks.runfolder import RunFolder
    from tests.draft_support import extracted_run
    from tests.s3_support import moto_s3

    cfg, params = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path, **SMALL_TRAIN)
    with moto_s3(monkeypatch) as s3:
        url = f"s3://{s3['bucket']}/runs/scaling"
        run = RunFolder(url, s3["storage_options"])
        run.fs.put(cfg.run_root + "/", run.path(""), recursive=True)
        data = yaml.safe_load(params.read_text())
        params.write_text(yaml.safe_dump({**data, "run_root": url, "storage_options": s3["storage_options"]}))
        assert _runner(monkeypatch, tmp_path).node_scaling("0.5") == 0
        (draft,) = scaling_drafts(run)
        assert draft["fraction"] == 0.5 and run.exists(f"{draft['final']}/config.json")
    assert not (tmp_path / "run/train/scaling").exists()  # trained in the store, not beside the params
