"""deployments/prefect.yaml, the GPU pool's job template and the automation files, without a
server: the deployments' parameters are the params profiles, the template renders GPU
placement, every automation is a valid Prefect automation. (tests/test_deployments_e2e.py
deploys and runs them on a real server.)"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.utilities.templating import apply_values

from tasks.config import load_config
from tests.run_support import ROOT, child_env


def _deployments() -> dict[tuple[str, str], dict]:
    spec = yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())
    return {(d["entrypoint"], d["name"]): d for d in spec["deployments"]}


def test_deployments_are_the_expected_set_on_the_expected_pools():
    deps = _deployments()
    pools = {key: d["work_pool"]["name"] for key, d in deps.items()}
    assert pools == {
        ("flows/data_scaling.py:data_scaling", "local-smoke"): "eaglescale-process",
        ("flows/data_scaling.py:data_scaling", "kimi-k25"): "eaglescale-process",
        ("flows/extract.py:extract_flow", "kimi-k25"): "eaglescale-gpu",
        ("flows/train.py:train_flow", "kimi-k25"): "eaglescale-gpu",
        ("flows/gate.py:gate_flow", "kimi-k25"): "eaglescale-gpu",
    }
    for (entrypoint, _), d in deps.items():
        path, _, func = entrypoint.partition(":")
        assert (ROOT / path).is_file() and f"def {func}(" in (ROOT / path).read_text()
        # local-smoke names its own run folder: not the one `make demo` completed.
        assert list(d["parameters"]) == (["run_root", "config"] if d["name"] == "local-smoke" else ["config"])
        assert "eaglescale" in d["tags"]  # the run-states automation matches on this tag


@pytest.mark.parametrize(
    ("name", "profile"), [("local-smoke", "smoke.yaml"), ("kimi-k25", "kimi-k25.yaml")]
)
def test_deployment_parameters_are_exactly_the_profile(name, profile, monkeypatch):
    expected = load_config(ROOT / "deployments/params" / profile)
    # A deployment's flow run validates its parameters in the pull step's folder, the checkout.
    monkeypatch.chdir(ROOT)
    configs = [d["parameters"]["config"] for (_, n), d in _deployments().items() if n == name]
    assert configs
    want = expected.model_dump()
    for config in configs:
        got = type(expected).model_validate(config).model_dump()
        differing = sorted(k for k in want if got[k] != want[k])
        assert not differing, f"deployments/prefect.yaml {name} differs from {profile} in {differing}"
        assert got == want


def test_every_pull_step_moves_to_the_checkout_root():
    """The copies' relative paths are relative to the checkout root (sync_profiles rebases them
    there), so every deployment's pull step must move to a checkout root."""
    spec = yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())
    dirs = {
        step["prefect.deployments.steps.set_working_directory"]["directory"]
        for d in spec["deployments"]
        for step in d.get("pull", spec["pull"])
    }
    assert dirs == {"{{ $EAGLESCALE_ROOT }}", "/opt/eaglescale"}
    dockerfiles = "".join(p.read_text() for p in (ROOT / "infra/docker").glob("*Dockerfile*"))
    assert "/opt/eaglescale" in dockerfiles  # the GPU image's checkout


def test_smoke_copy_paths_are_relative_to_the_checkout_root():
    (dep,) = [d for (_, n), d in _deployments().items() if n == "local-smoke"]
    config = dep["parameters"]["config"]
    assert config["target"]["model_path"] == ".eaglescale/tiny-target"
    assert config["run_root"] == ".eaglescale/runs/smoke"
    assert dep["parameters"]["run_root"] == ".eaglescale/runs/local-smoke"  # what the run uses
    for source in config["discover"]["sources"]:
        assert (ROOT / source["path"]).is_file(), source["path"]


def _sync_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_profiles", ROOT / "deployments/sync_profiles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sync_rebases_relative_paths_from_the_params_folder_to_the_checkout(tmp_path: Path) -> None:
    sync = _sync_module()
    params = tmp_path / "deployments/params"
    params.mkdir(parents=True)
    (params / "p.yaml").write_text(
        "run_root: ../../runs/x   # a comment stays\n"
        "target: {model_path: \"../../models/m\", revision: r}\n"
        "discover:\n"
        "  sources:\n"
        "    - {name: a, path: ../../data/a.jsonl, domain: d}\n"
        "    - {name: b, path: s3://bucket/b.jsonl, domain: d}\n"
        "    - {name: c, path: /abs/c.jsonl, domain: d}\n"
        "gate: {registry_url: ../reg}\n"
    )
    prefect_file = "x:\n  config:\n    # <profile: p>\n    # </profile>\n"
    out = sync.render(prefect_file, params, tmp_path)
    assert "    run_root: runs/x   # a comment stays\n" in out
    copy = yaml.safe_load(out)["x"]["config"]
    assert copy["target"] == {"model_path": "./models/m", "revision": "r"}  # not the hub id models/m
    assert [s["path"] for s in copy["discover"]["sources"]] == ["data/a.jsonl", "s3://bucket/b.jsonl", "/abs/c.jsonl"]
    assert copy["gate"]["registry_url"] == "deployments/reg"
    # A path the text does not spell out (an alias) cannot be rebased: refused, nothing written.
    (params / "p.yaml").write_text("x: &m ../../models/m\nrun_root: /r\ntarget: {model_path: *m}\n")
    with pytest.raises(sync.RebaseError, match="cannot find target.model_path: ../../models/m"):
        sync.render(prefect_file, params, tmp_path)


def test_kimi_parent_hands_gpu_stages_to_the_gpu_deployments():
    config = load_config(ROOT / "deployments/params/kimi-k25.yaml")
    deployed = {
        f"{d['entrypoint'].split(':')[1].removesuffix('_flow')}/{n}"
        for (_, n), d in _deployments().items()
        if d["work_pool"]["name"] == "eaglescale-gpu"
    }
    assert set(config.orchestration.stage_deployments.values()) == deployed
    assert config.orchestration.stage_deployments == {
        "extract": "extract/kimi-k25",
        "train": "train/kimi-k25",
        "gate": "gate/kimi-k25",
    }
    assert config.orchestration.gpu_concurrency_limit == "eaglescale-gpu"


def test_gpu_template_renders_gpu_limits_node_selector_and_shm():
    template = json.loads((ROOT / "infra/k8s/gpu-base-job-template.json").read_text())
    props = template["variables"]["properties"]
    job_vars = _deployments()[("flows/train.py:train_flow", "kimi-k25")]["work_pool"]["job_variables"]
    assert set(job_vars) <= set(props), set(job_vars) - set(props)
    # What a worker does: defaults, overridden by the deployment's job variables, rendered.
    values = {k: v["default"] for k, v in props.items() if "default" in v} | job_vars
    job = apply_values(template["job_configuration"], values)
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert container["resources"]["requests"] == {"nvidia.com/gpu": 8}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert "env" not in job  # nothing set, nothing rendered


def _automation_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("eaglescale_automations", ROOT / "infra/prefect/automations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_automation_files_are_valid_automations():
    mod = _automation_module()
    loaded = mod.load_automations(ROOT / "deployments/automations")
    block = str(uuid.uuid4())
    automations = {Path(p).name: AutomationCore.model_validate(mod.with_block(a, block)) for p, a in loaded}
    assert set(automations) == {"run-states.yaml", "stalled-generation.yaml", "zombie-flow-runs.yaml"}

    zombie = automations["zombie-flow-runs.yaml"]
    assert isinstance(zombie.trigger, EventTrigger) and zombie.trigger.posture == Posture.Proactive
    assert zombie.trigger.after == {"prefect.flow-run.heartbeat"}
    assert zombie.actions[0].type == "change-flow-run-state" and zombie.actions[0].state.value == "CRASHED"

    stalled = automations["stalled-generation.yaml"]
    assert stalled.trigger.posture == Posture.Proactive
    assert stalled.trigger.for_each == {"eaglescale.run_root"}
    # The events the generate flow emits (flows/generate.py): a commit keeps the window open,
    # the finished event closes it.
    source = (ROOT / "flows/generate.py").read_text()
    assert 'f"eaglescale.generate.shard.{outcome.status}"' in source
    assert '"eaglescale.generate.finished"' in source
    assert stalled.trigger.expect == {"eaglescale.generate.shard.committed", "eaglescale.generate.finished"}
    assert [str(a.block_document_id) for a in stalled.actions] == [block]

    states = automations["run-states.yaml"]
    assert states.trigger.expect == {
        "prefect.flow-run.Completed",
        "prefect.flow-run.Failed",
        "prefect.flow-run.Crashed",
    }
    assert [str(a.block_document_id) for a in states.actions] == [block]
    # No secret or server-specific id lives in the files.
    for path in (ROOT / "deployments/automations").iterdir():
        text = path.read_text()
        assert "hooks.slack.com" not in text and "xox" not in text


def test_automations_script_refuses_without_an_api_url(monkeypatch, capsys):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert _automation_module().main([]) == 2
    assert "PREFECT_API_URL is not set" in capsys.readouterr().err


def _local_server(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "infra/prefect/local_server.sh"), *args],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_local_server_script_arguments(tmp_path):
    assert "--database-url" in _local_server("--help").stdout
    bad = _local_server("--port", "x")
    assert bad.returncode == 2 and "--port must be a number, got 'x'" in bad.stderr
    assert _local_server("--nope").returncode == 2
    state = str(tmp_path / "state")
    dry = _local_server(
        "--dry-run", "--port", "4999", "--database-url", "postgresql+asyncpg://u@h/db",
        EAGLESCALE_PREFECT_STATE=state, PREFECT_HOME=str(tmp_path / "home"),
    )
    assert dry.returncode == 0, dry.stderr
    out = dry.stdout
    assert "PREFECT_API_URL=http://127.0.0.1:4999/api PREFECT_SERVER_ANALYTICS_ENABLED=false" in out
    assert "PREFECT_SERVER_DATABASE_CONNECTION_URL=postgresql+asyncpg://u@h/db" in out
    assert "server start --host 127.0.0.1 --port 4999" in out
    assert "worker start --pool eaglescale-process --type process" in out
    assert "deploy --prefect-file deployments/prefect.yaml --all" in out
    assert "automations.py --skip-notifications" in out
    assert "prefect deployment run 'data-scaling/local-smoke' --watch" in out
    assert "eaglescale status .eaglescale/runs/local-smoke --follow" in out
    assert not Path(state).exists()  # a dry run starts and writes nothing
    # A webhook in the environment: saved as blocks on the server, never printed.
    hook = "https://hooks.slack.com/services/T0/B0/DRYRUNSECRET"
    slack = _local_server("--dry-run", EAGLESCALE_PREFECT_STATE=state, SLACK_WEBHOOK_URL=hook)
    assert "automations.py --slack-webhook-from-env" in slack.stdout and "--skip-notifications" not in slack.stdout
    assert "DRYRUNSECRET" not in slack.stdout + slack.stderr


def test_profile_copies_are_rendered_from_the_params_files(tmp_path: Path) -> None:
    module = _sync_module()
    main, render = module.main, module.render
    assert main(["--check"]) == 0
    stale = tmp_path / "prefect.yaml"
    stale.write_text((ROOT / "deployments/prefect.yaml").read_text().replace("max_new_tokens: 32", "max_new_tokens: 8", 1))
    assert main(["--check", "--prefect-file", str(stale)]) == 1
    assert render(stale.read_text()) == (ROOT / "deployments/prefect.yaml").read_text()
