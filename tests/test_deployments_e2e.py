"""End to end on a real `prefect server start` (loopback): create the work pools, deploy every
deployment in deployments/prefect.yaml, apply the automations, start a process worker, and run
`prefect deployment run 'data-scaling/local-smoke' --watch` as an operator would.

Slack is a local receiver: the flows post through the Secret block `eaglescale-slack` that
`infra/prefect/automations.py --slack-webhook-from-env` saved (the worker has no Slack variable,
as `make server`'s has none unless its shell had one), and the run-states automation posts
through a notification block the server itself calls, so both alert paths are exercised.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.runfolder import RunFolder, ShardStore
from tests.prefect_support import prefect_server
from tests.run_support import ROOT, child_env
from tests.slack_support import Receiver

pytestmark = pytest.mark.slow  # ~95 s: a server, a worker and two watched deployment runs

SECRET = "XXXSECRETPATH"


def _prefect(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"{result.args}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _wait_for(predicate: Any, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


class Stack:
    def __init__(self, url: str, env: dict[str, str], slack: Receiver, home: Path):
        self.url, self.env, self.slack, self.home = url, env, slack, home

    def texts(self, path_prefix: str) -> list[str]:
        return [json.dumps(r["json"]) for r in self.slack.requests if r["path"].startswith(path_prefix)]

    def run_smoke(self, config: dict[str, Any], run_root: Path | None = None) -> subprocess.CompletedProcess:
        """The deployment with this config, on `run_root` (default: the config's). local-smoke's
        own `run_root` parameter (.eaglescale/runs/local-smoke, in the checkout) is always replaced."""
        params = {"config": config, "run_root": str(run_root or config["run_root"])}
        args = ["deployment", "run", "data-scaling/local-smoke", "--params", json.dumps(params)]
        return _prefect([*args, "--watch", "--watch-interval", "1", "--watch-timeout", "400"], self.env, 450)


def _smoke_config(run_root: Path, model_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """The deployment's own parameters, reduced to discover+generate on a run root in tmp."""
    spec = yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == "local-smoke"]
    config = dep["parameters"]["config"]
    config.update(run_root=str(run_root), stages=["discover", "generate"])
    config["target"]["model_path"] = str(model_dir)
    config["sampling"]["max_new_tokens"] = 8
    for name, values in sections.items():
        config[name].update(values)
    return config


def _create_notification_block(url: str, receiver_url: str) -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}):
        CustomWebhookNotificationBlock(
            name="eaglescale-test",
            url=f"{receiver_url}/automation",
            json_data={"text": "{{subject}}\n{{body}}"},
        ).save("eaglescale-test", overwrite=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("deploy-e2e") / "prefect-home"
    home.mkdir()
    with prefect_server(home) as url, Receiver() as slack:
        env = child_env()  # no host Slack/AWS/Prefect values
        env.update(
            PREFECT_API_URL=url,
            PREFECT_HOME=str(home),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_WORKER_QUERY_SECONDS="1",
            EAGLESCALE_ROOT=str(ROOT),
            HF_HUB_OFFLINE="1",
        )  # no Slack variable: the worker's flow runs read the Secret block saved below
        _ok(_prefect(["work-pool", "create", "eaglescale-process", "--type", "process"], env))
        template = str(ROOT / "infra/k8s/gpu-base-job-template.json")
        _ok(_prefect(["work-pool", "create", "eaglescale-gpu", "--type", "kubernetes", "--base-job-template", template], env))
        # Deployed without EAGLESCALE_ROOT: the worker's environment names the checkout at run time.
        deploy_env = {k: v for k, v in env.items() if k != "EAGLESCALE_ROOT"}
        _ok(_prefect(["--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all"], deploy_env))
        # Without a webhook, `make server`'s automations step says what it skipped and how to turn it on.
        script = [sys.executable, "infra/prefect/automations.py"]
        skipped = _ok(subprocess.run([*script, "--skip-notifications"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120))
        assert "skipped eaglescale-run-states, eaglescale-stalled-generation" in skipped, skipped
        assert "SLACK_WEBHOOK_URL=https://hooks.slack.com/services/... " in skipped and "--slack-webhook-from-env" in skipped
        # With one (the command it names): the flows' Secret block; the automations post through
        # the test's block (a SlackWebhook block would post to hooks.slack.com itself).
        _create_notification_block(url, slack.url)
        hook = {**env, "SLACK_WEBHOOK_URL": f"{slack.url}/services/T000/B000/{SECRET}"}
        apply = [*script, "--slack-webhook-from-env", "--slack-block", "custom-webhook/eaglescale-test"]
        applied = _ok(subprocess.run(apply, cwd=ROOT, env=hook, capture_output=True, text=True, timeout=120))
        assert "Secret block 'eaglescale-slack'" in applied and SECRET not in applied

        worker_log = open(home.parent / "worker.log", "wb")  # noqa: SIM115 - closed below
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "eaglescale-process", "--type", "process"],
            cwd=home.parent,
            env=env,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield Stack(url, env, slack, home)
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
            worker_log.close()


def test_deploy_all_registers_every_deployment_and_automation(stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: stack.url}), get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        deployments = {f"{flows[d.flow_id]}/{d.name}": d for d in client.read_deployments()}
        automations = {a.name for a in client.read_automations()}
    assert set(deployments) == {
        "data-scaling/local-smoke",
        "data-scaling/kimi-k25",
        "extract/kimi-k25",
        "train/kimi-k25",
        "gate/kimi-k25",
    }
    pools = {name: d.work_pool_name for name, d in deployments.items()}
    assert pools["data-scaling/local-smoke"] == pools["data-scaling/kimi-k25"] == "eaglescale-process"
    assert {pools[n] for n in ("extract/kimi-k25", "train/kimi-k25", "gate/kimi-k25")} == {"eaglescale-gpu"}
    for name in ("extract/kimi-k25", "train/kimi-k25", "gate/kimi-k25"):
        assert deployments[name].job_variables["gpu_count"] == 8
        assert deployments[name].job_variables["node_selector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    kimi = deployments["data-scaling/kimi-k25"].parameters["config"]
    assert kimi["orchestration"]["stage_deployments"]["train"] == "train/kimi-k25"
    # The CPU pull step stays a placeholder on the server: each worker resolves its own
    # checkout. The GPU image has it at a fixed path.
    for name, d in deployments.items():
        where = "/opt/eaglescale" if pools[name] == "eaglescale-gpu" else "{{ $EAGLESCALE_ROOT }}"
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": where}}]
    assert automations == {
        "eaglescale-run-states",
        "eaglescale-stalled-generation",
        "eaglescale-zombie-flow-runs",
    }
    # Applying again replaces instead of duplicating.
    apply = [sys.executable, "infra/prefect/automations.py", "--slack-block", "custom-webhook/eaglescale-test"]
    _ok(subprocess.run(apply, cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=120))
    with temporary_settings(updates={PREFECT_API_URL: stack.url}), get_client(sync_client=True) as client:
        assert sorted(a.name for a in client.read_automations()) == sorted(automations)


def test_watched_smoke_run_completes_with_committed_shards(stack, tmp_path, tiny_target_dir):
    run_root = tmp_path / "run"
    # The flow's `run_root` parameter picks the run folder (the README's fresh run), over the config's.
    result = stack.run_smoke(_smoke_config(tmp_path / "not-this-one", tiny_target_dir), run_root)
    out = _ok(result)
    assert "Completed" in out
    store = ShardStore(RunFolder(str(run_root)), "generate")
    committed = store.committed()
    assert len(committed) == 7 and store.is_complete()  # 276 prompts in shards of 40
    assert sum(m["rows"] for m in committed.values()) == 276
    # The relative source paths resolved against the checkout (the pull step), not the
    # worker's temporary folder.
    assert RunFolder(str(run_root)).exists("prompts/_SUCCESS.json")
    assert not (tmp_path / "not-this-one").exists()
    hooks = stack.texts("/services/")
    assert any("generate completed" in t for t in hooks), hooks
    # The server-side automation reports the parent run's final state through the block.
    assert _wait_for(lambda: any("data-scaling/" in t and "Completed" in t for t in stack.texts("/automation")), 90), (
        stack.texts("/automation")
    )


def test_failed_stage_makes_watch_exit_nonzero_and_reaches_slack(stack, tmp_path, tiny_target_dir):
    run_root = tmp_path / "run"
    config = _smoke_config(run_root, tiny_target_dir)
    config["discover"]["sources"] = [
        {"name": "missing", "path": "tasks/data/sample_prompts/does-not-exist.jsonl", "domain": "general_chat"}
    ]
    before = len(stack.texts("/automation"))
    result = stack.run_smoke(config)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "Failed" in result.stdout
    hooks = stack.texts("/services/")
    assert any("discover FAILED" in t and "does-not-exist" in t for t in hooks), hooks
    assert _wait_for(lambda: any("Failed" in t for t in stack.texts("/automation")[before:]), 90), (
        stack.texts("/automation")
    )
    assert ShardStore(RunFolder(str(run_root)), "generate").committed() == {}
    for text in stack.texts("/"):
        assert SECRET not in text
    assert SECRET not in result.stdout + result.stderr


def test_stage_named_in_stage_deployments_runs_as_a_child_deployment(stack, tmp_path, tiny_target_dir):
    """What kimi-k25 does with its GPU stages, on the process pool: the parent hands `generate`
    to its own deployment through run_deployment, and the child run shows under the parent."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deploy = ["--no-prompt", "deploy", "flows/generate.py:generate_flow", "-n", "e2e-child", "-p", "eaglescale-process"]
    _ok(_prefect(deploy, stack.env))
    try:
        run_root = tmp_path / "run"
        config = _smoke_config(run_root, tiny_target_dir)
        config["orchestration"] = {"stage_deployments": {"generate": "generate/e2e-child"}}
        out = _ok(stack.run_smoke(config))
        assert "Completed" in out
        committed = ShardStore(RunFolder(str(run_root)), "generate").committed()
        assert len(committed) == 7 and sum(m["rows"] for m in committed.values()) == 276
        with temporary_settings(updates={PREFECT_API_URL: stack.url}), get_client(sync_client=True) as client:
            (child_deployment,) = [d for d in client.read_deployments() if d.name == "e2e-child"]
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=False))
            )
            mine = [r for r in children if r.deployment_id == child_deployment.id]
            assert len(mine) == 1 and mine[0].state.is_completed()
            assert mine[0].parameters["config"]["run_root"] == str(run_root)
    finally:
        # The stack is shared by the module: leave it with the deployments `deploy --all`
        # made, whatever order the tests run in (the first test asserts that exact set).
        _ok(_prefect(["deployment", "delete", "generate/e2e-child"], stack.env))
