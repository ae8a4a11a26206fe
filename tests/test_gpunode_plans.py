"""gpunode's plans and the node's calls: the pipeline process runs on the node's own Python,
which has no pydantic (only the processes it starts get the bundle's site folder; a real run once
died when the pipeline itself loaded the profile through tasks.config), so the pipeline's modules
import nothing of eaglescale's or pydantic's, read from the source, except under `if
node_env.EXTRA_SETS:` (a CPU rehearsal, which runs in the project's venv); the plans' settings
load with the profiles; `node receive|start|wait` and what `node wait` brings back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode import collection, lifecycle, node_env, plans, setup, travel
from gpunode.pipeline import Pipeline
from tests.gpunode_support import QWEN, REPO, on_node

NODE_ONLY = ("tasks", "flows", "pydantic", "prefect", "torch", "transformers")
# What the node's own Python loads: the entry point, `node receive|start|wait` and the pipeline.
# steps.py, gate_plan.py and the measurements run as helper processes on the bundle's site folder.
PIPELINE_MODULES = ("cli", "node_env", "plans", "lifecycle", "collection", "travel", "import_profile", "pipeline",
                    "core", "setup", "generation", "training", "session_train", "gate_session", "packing",
                    "plan_runs", "recipe")  # fmt: skip


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
    found, imported = [], set()
    for name in PIPELINE_MODULES:
        tree = ast.parse((REPO / "gpunode" / f"{name}.py").read_text())
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Call) and _named(node.func, "_config"):
                names = ["tasks.config (through _config)"]
            imported.update(names)
            found += [f"{name}.py line {node.lineno}: {n}" for n in names
                      if n.split(".")[0] in NODE_ONLY and not _rehearsal_only(node, parents)]  # fmt: skip
    assert found == []
    # The reader sees the imports the pipeline does make (a check that cannot pass vacuously).
    assert {"yaml", "gpunode.core", "tasks.config"} <= imported


def test_the_entry_point_loads_none_of_what_the_node_image_lacks() -> None:
    """`python3 -m gpunode node pipeline` imports the pipeline's modules before it runs: none of
    them may import tasks/, pydantic and the like at module level (loaded in a fresh interpreter,
    which then lists what it imported). The helper processes run the entry point itself."""
    import json

    code = ("import json, sys; " + "; ".join(f"import gpunode.{m}" for m in PIPELINE_MODULES)
            + "; print(json.dumps(sorted(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert sorted(m for m in loaded if m.split(".")[0] in NODE_ONLY) == []
    assert {"gpunode.pipeline", "gpunode.session_train", "gpunode.gate_session"} <= loaded
    helper = subprocess.run([sys.executable, *node_env.node_step("--help")], capture_output=True, text=True, cwd=REPO)
    assert helper.returncode == 0 and "gate-plan" in helper.stdout


def test_skip_leaves_the_scaling_drafts_out_of_every_stage_and_the_helpers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`node start --skip scaling --skip anchor` (run 5): the stages get the override, and the
    helper processes' params.yaml has no scaling fractions (read with yaml, as the node does)."""
    import json

    import yaml

    monkeypatch.setattr(node_env, "NODE", tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    plain = Pipeline()
    registry = f"gate.registry_url={tmp_path / 'registry'}"  # every stage promotes into the node's registry
    assert plain.skip == [] and plain.sets == [registry]
    (tmp_path / "options.json").write_text(json.dumps({"skip": ["scaling", "anchor"]}))
    pipeline = Pipeline()
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
    pipeline = Pipeline()
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
    pipeline = Pipeline()
    assert pipeline.plan == "online-incumbent"
    assert sorted(pipeline.skip) == ["anchor", "scaling", "sweep"]
    online = load_config(node_env.PROFILE, overrides=[*pipeline.sets, "train.hidden_states=online"])
    small = load_config(node_env.PROFILE, overrides=[*pipeline.sets, f"train.max_train_sequences={node_env.SMALL_RUN_SEQUENCES}"])
    assert online.train.hidden_states == "online" and online.train.scaling_fractions == []
    assert small.train.max_train_sequences == 1004 and small.gate.num_steps == [3]
    assert online.gate.registry_url == small.gate.registry_url == str(tmp_path / "registry")


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

    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    options = plans.plan_options([], "recipe", ["noise"])
    assert options == {"skip": ["scaling", "sweep"], "plan": "recipe", "variants": ["default", "noise"]}
    (tmp_path / "options.json").write_text(json.dumps(options))
    pipeline = Pipeline()
    assert pipeline.variants == ["default", "noise"]
    (tmp_path / "options.json").write_text(json.dumps({"skip": plans.PLANS["recipe"], "plan": "recipe"}))
    pipeline = Pipeline()
    assert pipeline.variants == plans.RECIPE_PLANNED and set(plans.RECIPE_PLANNED) < set(plans.RECIPE_VARIANTS)
    # SpecForge may train until the recipe plan's own last steps need the time, not the full plan's.
    import time

    (tmp_path / "deadline.json").write_text(json.dumps({"ends_at": time.time() + 1000, "budget_s": 1000}))
    recipe_left = pipeline.seconds_left()
    (tmp_path / "options.json").write_text(json.dumps({"skip": [], "plan": "full"}))
    full_left = Pipeline().seconds_left()
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


def test_node_start_refuses_what_cannot_run_before_starting_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan that probes a carried draft on a payload without one, a carried SpecForge draft on a
    plan that does not gate it, a --set that is not SECTION.KEY=VALUE, and `node recipe-variant`
    without a finished recipe plan or with an unknown variant are refused before anything runs
    (no pipeline, no options.json, no run root); a good --set
    reaches the stages and params.yaml over the plan's own settings."""
    import json

    import yaml

    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(node_env, "EXTRA_SETS", [])
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "carried": {"generation": True, "draft": False}}))
    assert lifecycle.node_start(None, [], "verify-probe") == 2  # the probe's server serves a carried draft
    assert lifecycle.node_start(None, [], "qwen-gate", overrides=["epochs=2"]) == 2
    # One more recipe variant (`node recipe-variant`) follows a finished recipe plan, and names a variant.
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "recipe", None)))
    assert Pipeline().recipe_variant("noise") == 2  # nothing finished on this machine
    (tmp_path / "status.json").write_text(json.dumps({"steps": {"finished": {"state": "done"}}}))
    assert Pipeline().recipe_variant("noise2") == 2
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
    pipeline = Pipeline()
    assert "train.epochs=2" in pipeline.sets and "gate.num_steps=[3, 4]" in pipeline.sets
    assert "gate.topk_points=[]" in pipeline.sets and "gate.breakeven_num_steps=[3]" in pipeline.sets  # the plan's own
    pipeline.write_params()
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert params["train"]["epochs"] == 2 and params["gate"]["num_steps"] == [3, 4]
    assert params["target"]["model_path"] == "multipart://qwen2.5-coder-1.5b-instruct"


def test_a_node_given_a_start_draft_trains_its_draft_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare --start-from drafts.tar`: the exported draft of an earlier session travels beside
    the run, and the node's params start the draft from it (train.init_from) with no scaling
    drafts (a continued draft is no point of a from-scratch curve); the params still load."""
    import json
    import tarfile

    from tasks.config import load_config

    on_node(monkeypatch, tmp_path)
    final = tmp_path / "shipped/run/train/final"
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"draft_vocab_size": 32000}')
    (final / "model.safetensors").write_bytes(b"weights")
    (final.parent / "result.json").write_text("{}")
    packed = tmp_path / "drafts.tar"
    with tarfile.open(packed, "w") as tar:
        tar.add(tmp_path / "shipped/run", "run")
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(REPO))}))
    (tmp_path / "options.json").write_text(json.dumps(plans.plan_options([], "qwen-gate", None)))
    pipeline = Pipeline()
    assert travel.carried_start_draft() is None and "init_from" not in pipeline.params_data()["train"]
    start = travel.unpack_start_draft(packed, tmp_path / "src")  # what setup unpacks of the payload
    assert start == tmp_path / travel.START_DRAFT and sorted(p.name for p in start.iterdir()) == ["config.json", "model.safetensors"]
    assert travel.carried_start_draft() == start
    pipeline._start_from_carried_draft()  # setup's, once the payload is unpacked
    for given in (pipeline, Pipeline()):  # and a pipeline restarted on that node
        train = given.params_data()["train"]
        assert train["init_from"] == str(start) and train["scaling_fractions"] == []
        # every stage's --set says the same as params.yaml, and the profile loads with them
        cfg = load_config(QWEN, overrides=given.sets)
        assert cfg.train.init_from == str(start) and cfg.train.scaling_fractions == []


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
    facts = setup.host_facts(cpuinfo)
    assert facts["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480C" and facts["cpu_count"] >= 1
    gpu = facts["gpus"][0]
    assert gpu["name"] == "NVIDIA H200" and gpu["clocks.max.sm"] == "1980 MHz" and gpu["power.limit"] == "700.00 W"
    assert gpu["persistence_mode"] == "Enabled"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    bare = setup.host_facts(tmp_path / "no-cpuinfo")
    assert bare["gpus"].startswith("nvidia-smi:") and bare["cpu_model"].startswith("unreadable:")


def test_the_kernel_caches_a_session_filled_are_weighed(tmp_path: Path) -> None:
    """Whether carrying Triton's and inductor's caches to a fresh machine is worth a call: their
    files and bytes, each cache apart; a cache never filled weighs nothing."""
    (tmp_path / "triton" / "abc").mkdir(parents=True)
    (tmp_path / "triton" / "abc" / "kernel.cubin").write_bytes(b"x" * 1000)
    (tmp_path / "triton" / "abc" / "kernel.json").write_bytes(b"{}")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "big").write_bytes(b"x" * 5000)
    sizes = setup.kernel_cache_sizes(tmp_path)
    assert sizes == {"triton": {"files": 2, "bytes": 1002}, "inductor": {"files": 0, "bytes": 0}}


def test_node_receive_keeps_a_part_that_arrives_on_a_replaced_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run 15 lost its machine between parts 19 and 20: the next calls found a fresh one. A part
    is kept whatever came before it, the call says which earlier parts to send again (exit 3),
    and only those are sent again; a part whose bytes do not match its sha256 is not kept."""
    import hashlib
    import json

    on_node(monkeypatch, tmp_path / "node")
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

    on_node(monkeypatch, tmp_path)
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

    on_node(monkeypatch, tmp_path)
    logs = tmp_path / "run/gate/server-logs"
    logs.mkdir(parents=True)
    args = b"[20:19:24] server_args=ServerArgs(" + b"a" * 9_400 + b")\n"  # one line, as SGLang writes it
    start = b"".join(b"[20:19:%02d] Load weight end. mem usage=3.1 GB\n" % k for k in range(60))
    end = b"Decode batch, accept len: 1.92\n" * 1_000
    (logs / "003-eagle3-s3-k1-n4-rep0.log").write_bytes(args + start + b"x\n" * 25_000 + end)
    collection.collect_node_results(tmp_path / "out")
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

    on_node(monkeypatch, tmp_path)
    (tmp_path / "run/train").mkdir(parents=True)
    record = {"splits": {"train": 38_873, "eval": 793}, "hidden_states": "online"}
    (tmp_path / "run/train/data.json").write_text(json.dumps(record))
    collection.collect_node_results(tmp_path / "out")
    with tarfile.open(tmp_path / "out/results.tar.gz") as tar:
        assert json.load(tar.extractfile("run/train/data.json")) == record


def test_node_wait_on_a_machine_that_started_bare_says_so_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run 13 lost its machine between two `node wait` calls; the next call started a fresh one
    and waited out the session's last 346 s of device time for a pipeline that was not there."""
    import time

    on_node(monkeypatch, tmp_path)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    began = time.monotonic()
    assert lifecycle.node_wait(timeout=60) == 3
    assert time.monotonic() - began < 5 and "no pipeline was started on this machine" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing that reads as results


def test_the_node_profiles_the_servers_import_and_brings_it_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run 24's launches spent ~50 s of their 61-81 s before the scheduler's first line (P31):
    setup times SGLang's import twice in the background (`python -X importtime`), by package and
    by module, and `node wait` brings it back. Here on a module this machine has."""
    import json
    import os
    import sys
    import tarfile

    from gpunode.import_profile import (
        IMPORT_PROFILE,
        profile_in_background,
        summarize_importtime,
    )

    on_node(monkeypatch, tmp_path)
    thread = profile_in_background(sys.executable, dict(os.environ), tmp_path / IMPORT_PROFILE, module="email.message")
    thread.join(timeout=60)
    profile = json.loads((tmp_path / IMPORT_PROFILE).read_text())
    assert profile["module"] == "email.message" and len(profile["runs"]) == 2
    for run in profile["runs"]:
        assert "error" not in run and run["modules"] > 5 and 0 < run["total_s"] < run["wall_s"]
        assert dict(run["by_package"])["email"] > 0
    collection.collect_node_results(tmp_path / "out")
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


