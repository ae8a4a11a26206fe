"""Params files: both shipped profiles load; unknown or ill-typed keys name the key and file;
contradicting settings are refused naming both keys; relative paths resolve against the params
file's folder (or the working directory for --set), and a missing input path is named with its
absolute form and its base."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tasks.config import PATH_KEYS, ConfigError, EagleScaleConfig, check_input_paths, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "deployments/params/smoke.yaml"
KIMI = ROOT / "deployments/params/kimi-k25.yaml"


@pytest.mark.parametrize("name", ["smoke.yaml", "kimi-k25.yaml"])
def test_shipped_params_load(name):
    cfg = load_config(ROOT / "deployments" / "params" / name)
    assert isinstance(cfg, EagleScaleConfig)
    assert cfg.discover.sources


def test_kimi_profile_is_production_shaped():
    cfg = load_config(ROOT / "deployments/params/kimi-k25.yaml")
    assert cfg.run_root.startswith("s3://")
    assert cfg.engine.kind == "sglang" and len(cfg.engine.endpoints) >= 2
    assert cfg.discover.total_prompts == 83288


def test_unknown_key_names_key_and_file(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("run_root: /tmp/x\ntarget: {model_path: /m}\ngenerate: {shard_sise: 10}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert f"{p}: unknown key 'generate.shard_sise'" in str(err.value)


def test_ill_typed_key_names_key(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("run_root: /tmp/x\ntarget: {model_path: /m}\nsampling: {max_new_tokens: lots}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "key 'sampling.max_new_tokens'" in str(err.value) and str(p) in str(err.value)


def test_overrides_apply_and_are_validated(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("run_root: /tmp/x\ntarget: {model_path: /m}\n")
    cfg = load_config(
        p, ["generate.shard_size=7", "engine.kind=sglang", "engine.endpoints=[http://a:1/]"], run_root="/tmp/y"
    )
    assert cfg.generate.shard_size == 7
    assert cfg.engine.endpoints == ["http://a:1"]
    assert cfg.run_root == "/tmp/y"
    with pytest.raises(ConfigError, match="unknown key 'engine.endpiont'"):
        load_config(p, ["engine.endpiont=x"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(p, ["engine.kind"])
    # A --set value is YAML, but '#' would start a comment there and drop the value silently:
    # text YAML reads as nothing (or cuts at a '#') is the text itself; null is only null.
    assert load_config(p, ["slack.channel=#ops-alerts"]).slack.channel == "#ops-alerts"
    assert load_config(p, ["slack.channel=  #x  "]).slack.channel == "#x"
    assert load_config(p, ["slack.channel=ops #alerts"]).slack.channel == "ops #alerts"
    assert load_config(p, ["slack.channel='#quoted'"]).slack.channel == "#quoted"
    assert load_config(p, ["slack.channel=#x", "slack.channel=null"]).slack.channel is None
    assert load_config(p, ["slack.channel=~"]).slack.channel is None


def test_overrides_reach_into_a_list_the_params_hold(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(
        "run_root: /tmp/x\ntarget: {model_path: /m}\n"
        "discover:\n  sources:\n"
        "    - {name: a, path: a.jsonl, domain: chat}\n"
        "    - {name: b, path: b.jsonl, domain: code}\n"
    )
    cfg = load_config(p, ["discover.sources[1].prompt_turns=every_user", "discover.sources[0].path=c.jsonl"])
    a, b = cfg.discover.sources
    assert (a.prompt_turns, b.prompt_turns) == ("through_last_user", "every_user")
    # The value set is relative to the working directory, the other source's to the file.
    assert a.path == str(Path.cwd() / "c.jsonl") and b.path == str(tmp_path / "b.jsonl")
    bases = {o.key: o.base for o in cfg.path_origins()}
    assert (bases["discover.sources[0].path"], bases["discover.sources[1].path"]) == (Path.cwd(), tmp_path)
    with pytest.raises(ConfigError, match=r"'discover.sources' has 2 item\(s\); index 2 is past its end"):
        load_config(p, ["discover.sources[2].domain=x"])
    with pytest.raises(ConfigError, match=r"'discover.seed' is not a list"):
        load_config(p, ["discover.seed[0]=1"])
    with pytest.raises(ConfigError, match=r"unknown key 'discover.sources.1.prompt_turn'"):
        load_config(p, ["discover.sources[1].prompt_turn=every_user"])


# ---- contradictions: one key silently ignored because of another ---------------------------


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["engine.endpoints=[http://host:30000]"], ["engine.endpoints", "engine.kind is 'local'"]),
        (["engine.kind=sglang"], ["engine.kind is 'sglang'", "engine.endpoints is empty"]),
        (["engine.endpoint_kind=router"], ["engine.endpoint_kind is 'router'", "engine.kind is 'local'"]),
        (["extract.engine=sglang"], ["extract.engine is 'sglang'", "extract.device is 'cpu'"]),
        (
            ["train.hidden_states=online", "extract.engine=sglang", "extract.device=cuda"],
            ["train.hidden_states is 'online'", "extract.engine is 'sglang'"],
        ),
        (
            ["gate.topk_points=[{num_steps: 2, topk: 2, num_draft_tokens: 4}]"],
            ["gate.topk_points", "gate.engine is 'local'"],
        ),
        (["gate.nccl_env_sweep=[{}, {NCCL_ALGO: Ring}]"], ["gate.nccl_env_sweep", "gate.engine is 'local'"]),
        (["gate.engine=emulated", "gate.cuda_graphs=false"], ["gate.cuda_graphs is false", "gate.engine is 'emulated'"]),
    ],
)
def test_contradicting_settings_are_refused_naming_both_keys(overrides, keys):
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, overrides)
    message = str(err.value)
    assert str(SMOKE) in message
    for key in keys:
        assert key in message
    assert "<root>" not in message and "(got {" not in message  # not the whole config dumped


def test_contradictions_are_refused_for_a_deployments_parameters_too():
    data = yaml.safe_load(SMOKE.read_text())
    data["engine"]["endpoints"] = ["http://host:30000"]
    with pytest.raises(ValidationError, match=r"engine.endpoints lists .* but engine.kind is 'local'"):
        EagleScaleConfig.model_validate(data)


@pytest.mark.parametrize(
    ("profile", "overrides"),
    [
        # Switching a production profile to the local engine: only the servers must go; the
        # sglang tuning knobs (concurrency, timeouts) may stay.
        (KIMI, ["engine.kind=local", "engine.endpoints=[]"]),
        (SMOKE, ["engine.kind=sglang", "engine.endpoints=[http://a:30000]", "engine.endpoint_kind=router"]),
        (SMOKE, ["train.nproc=2"]),  # torchrun with gloo on the CPU is a supported setup
        (SMOKE, ["train.hidden_states=online"]),  # extract.* then names the capture's settings
        (SMOKE, ["gate.engine=emulated", "gate.topk_points=[{num_steps: 2, topk: 2, num_draft_tokens: 4}]"]),
        (SMOKE, ["gate.topk_points=[{num_steps: 3, topk: 1}]"]),  # a chain: the local engine runs it
        (SMOKE, ["extract.engine=sglang", "extract.device=cuda"]),
    ],
)
def test_legitimate_combinations_are_not_refused(profile, overrides):
    load_config(profile, overrides)


def test_defaults_contradict_nothing():
    # The default gate sweep includes a topk=4 point for SGLang; the local engine documents
    # that it skips it, so a minimal params file is not refused for a default.
    cfg = EagleScaleConfig.model_validate({"run_root": "/tmp/x", "target": {"model_path": "/m"}})
    assert cfg.gate.engine == "local" and cfg.gate.topk_points


# ---- paths ---------------------------------------------------------------------------------


def _params(folder: Path, **data) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_relative_paths_resolve_against_the_params_files_folder(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "model").mkdir()
    (conf / "tmpl.jinja").write_text("{{ messages }}")
    params = _params(
        conf,
        run_root="runs/x",
        target={"model_path": "./model", "chat_template": "tmpl.jinja"},
        discover={"sources": [
            {"name": "a", "path": "data/*.jsonl", "domain": "d"},
            {"name": "b", "path": "../shared/b.jsonl", "domain": "d"},
            {"name": "c", "path": "s3://bucket/c.jsonl", "domain": "d"},
            {"name": "p", "path": "package://tasks/data/sample_prompts/reasoning.jsonl", "domain": "d"},
            {"name": "abs", "path": "/data/abs.jsonl", "domain": "d"},
        ]},
        gate={"registry_url": "registry", "python": "venv/bin/python"},
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(params)
    assert cfg.run_root == str(conf / "runs/x")
    assert cfg.target.model_path == str(conf / "model")
    assert cfg.target.chat_template == str(conf / "tmpl.jinja")
    assert [s.path for s in cfg.discover.sources] == [
        str(conf / "data/*.jsonl"),
        str(tmp_path / "shared/b.jsonl"),
        "s3://bucket/c.jsonl",
        "package://tasks/data/sample_prompts/reasoning.jsonl",
        "/data/abs.jsonl",
    ]
    assert cfg.gate.registry_url == str(conf / "registry")
    assert cfg.gate.python == str(conf / "venv/bin/python")
    # The same file from another working directory means the same run.
    monkeypatch.chdir(tmp_path)
    assert load_config(params) == cfg


def test_values_that_are_not_local_paths_are_kept(tmp_path, monkeypatch):
    params = _params(
        tmp_path / "conf",
        run_root="s3://bucket/runs/x",
        target={"model_path": "org/model", "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        gate={"registry_url": "s3://bucket/registry", "python": "python3"},
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(params)
    assert cfg.run_root == "s3://bucket/runs/x"
    assert cfg.target.model_path == "org/model"  # a hub id: no such folder next to the file
    assert cfg.target.chat_template.startswith("{% for")
    assert (cfg.gate.registry_url, cfg.gate.python) == ("s3://bucket/registry", "python3")
    (tmp_path / "conf/org/model").mkdir(parents=True)
    assert load_config(params).target.model_path == str(tmp_path / "conf/org/model")


def test_overrides_and_run_root_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    params = _params(tmp_path / "conf", run_root="runs/x", target={"model_path": "./model"})
    monkeypatch.chdir(tmp_path)
    cfg = load_config(params, ["target.model_path=./other"], run_root="here/run")
    assert cfg.target.model_path == str(tmp_path / "other")
    assert cfg.run_root == str(tmp_path / "here/run")
    cfg = load_config(params, ["discover.sources=[{name: a, path: a.jsonl, domain: d}]"])
    assert cfg.discover.sources[0].path == str(tmp_path / "a.jsonl")
    assert cfg.run_root == str(tmp_path / "conf/runs/x")


def test_parameters_given_as_a_dict_resolve_against_the_working_directory(tmp_path, monkeypatch):
    # What a deployment's flow run does: its pull step sets the working directory.
    monkeypatch.chdir(tmp_path)
    data = {"run_root": "runs/x", "target": {"model_path": ".eaglescale/tiny-target"}}
    cfg = EagleScaleConfig.model_validate(data)
    assert (cfg.run_root, cfg.target.model_path) == (str(tmp_path / "runs/x"), str(tmp_path / ".eaglescale/tiny-target"))
    assert data["run_root"] == "runs/x"  # the caller's dict is not changed
    # A serialized config (a child deployment's parameters) keeps its absolute paths anywhere.
    monkeypatch.chdir(ROOT)
    assert EagleScaleConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_shipped_smoke_profile_means_the_checkout_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(SMOKE)
    assert cfg.run_root == str(ROOT / ".eaglescale/runs/smoke")
    assert cfg.target.model_path == str(ROOT / ".eaglescale/tiny-target")
    assert cfg.gate.registry_url == str(ROOT / ".eaglescale/registry")
    for source in cfg.discover.sources:
        assert Path(source.path).is_file(), source.path
        assert Path(source.path).parent == ROOT / "tasks/data/sample_prompts"


def test_path_keys_name_fields_of_the_model():
    for spec in PATH_KEYS:
        model: type = EagleScaleConfig
        parts = spec.key.split(".")
        for part in parts[:-1]:
            annotation = model.model_fields[part.removesuffix("[]")].annotation
            model = annotation.__args__[0] if part.endswith("[]") else annotation
        assert parts[-1] in model.model_fields, spec.key


def test_missing_input_paths_name_the_absolute_path_and_the_base(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    params = _params(
        conf,
        run_root="runs/not-yet",  # an output: need not exist
        target={"model_path": "../models/tiny", "chat_template": "t.jinja"},
        discover={"sources": [{"name": "a", "path": "data/*.jsonl", "domain": "d"}]},
        gate={"registry_url": "registry"},
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        check_input_paths(load_config(params, ["discover.sources=[{name: b, path: nope.jsonl, domain: d}]"]))
    message = str(err.value)
    assert f"target.model_path: no model folder or .gguf file at {tmp_path / 'models/tiny'}" in message
    assert f"'../models/tiny' relative to the folder of the params file {params}, {conf}" in message
    assert f"target.chat_template: no chat template file at {conf / 't.jinja'}" in message
    assert f"discover.sources[0].path: no file or folder at {tmp_path / 'nope.jsonl'}" in message
    assert f"relative to the working directory (a --set or --run-root value), {tmp_path}" in message
    assert "run_root" not in message and "registry" not in message
    with pytest.raises(ConfigError, match=r"discover.sources\[0\].path: no file matches .*conf/data/\*.jsonl"):
        check_input_paths(load_config(params, [f"target.model_path={tmp_path}", "target.chat_template=null"]))


def test_an_empty_source_and_a_local_gguf_target(tmp_path):
    """An empty prompt file is refused before anything starts (its domain would vanish); a
    .gguf file is a target like a folder (converted when first loaded)."""
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    params = _params(
        tmp_path,
        run_root="run",
        target={"model_path": "model.gguf"},
        discover={"sources": [{"name": "a", "path": "empty.jsonl", "domain": "chat"}]},
    )
    with pytest.raises(ConfigError) as err:
        check_input_paths(load_config(params))
    assert f"discover.sources[0].path: {tmp_path / 'empty.jsonl'} is empty (0 bytes)" in str(err.value)
    assert "target.model_path" not in str(err.value)
    (tmp_path / "empty.jsonl").write_text('{"prompt": "hi"}\n')
    check_input_paths(load_config(params))


def test_missing_package_path_is_named(tmp_path):
    params = _params(
        tmp_path,
        run_root="run",
        target={"model_path": str(tmp_path)},
        discover={"sources": [{"name": "a", "path": "package://tasks/data/nope.jsonl", "domain": "d"}]},
    )
    with pytest.raises(ConfigError, match=r"discover.sources\[0\].path: package://tasks/data/nope.jsonl: package 'tasks' is installed at .* but holds no 'data/nope.jsonl'"):
        check_input_paths(load_config(params))
    # Inputs of a stage that does not run here are not required.
    check_input_paths(load_config(params, ["stages=[train]"]))


def test_challenger_paths_resolve_against_the_params_folder_and_a_missing_one_is_the_gates_to_report(tmp_path: Path) -> None:
    from tasks.config import ConfigError, check_input_paths, load_config

    model = tmp_path / "model"
    model.mkdir()
    params = tmp_path / "p" / "params.yaml"
    params.parent.mkdir()
    params.write_text(
        f"run_root: run\nstages: [gate]\ntarget: {{model_path: {model}}}\n"
        "gate: {engine: emulated, challengers: [{name: public, path: ../drafts/public}, {name: s3, path: s3://b/d}]}\n"
    )
    cfg = load_config(params)
    assert [c.path for c in cfg.gate.challengers] == [str(tmp_path / "drafts" / "public"), "s3://b/d"]
    # Missing: not refused before the run; the gate reports the challenger and leaves it out.
    check_input_paths(cfg)
    params.write_text(params.read_text().replace("challengers", "reference_drafts"))
    with pytest.raises(ConfigError, match=r"gate.reference_drafts is now gate.challengers \(the same fields"):
        load_config(params)
