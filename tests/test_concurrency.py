"""flows/concurrency.py against a real `prefect server start`: one holder per stage and run
root (a second process is refused by name), and GPU slots out of one shared limit."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.concurrency import (
    GpuLimitError,
    canonical_run_root,
    gpu_slots,
    run_root_limit_name,
    run_root_lock,
)
from tasks.config import EagleScaleConfig, load_config
from tests.prefect_support import prefect_server
from tests.run_support import ROOT


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("concurrency") / "prefect-home"
    home.mkdir()
    with prefect_server(home) as url, temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


def _config(run_root: str, gpu_limit: str | None = None) -> EagleScaleConfig:
    overrides = [f"orchestration.gpu_concurrency_limit={gpu_limit}"] if gpu_limit else []
    return load_config(ROOT / "deployments/params/smoke.yaml", overrides, run_root=run_root)


def _try_lock_in_another_process(url: str, run_root: str, stage: str) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        "from flows.concurrency import run_root_lock\n"
        "from tasks.config import load_config\n"
        f"cfg = load_config('deployments/params/smoke.yaml', run_root={run_root!r})\n"
        "try:\n"
        f"    with run_root_lock(cfg, {stage!r}, timeout_s=1):\n"
        "        print('ACQUIRED')\n"
        "except Exception as e:\n"
        "    print(f'{type(e).__name__}: {e}'); sys.exit(3)\n"
    )
    env = dict(os.environ, PREFECT_API_URL=url, PREFECT_LOGGING_LEVEL="ERROR")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_limit_names_are_one_per_stage_and_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert canonical_run_root("runs/a/") == str(tmp_path / "runs/a")
    assert run_root_limit_name("runs/a", "generate") == run_root_limit_name(str(tmp_path / "runs/a/"), "generate")
    assert run_root_limit_name("s3://b/p/", "generate") == run_root_limit_name("s3://b/p", "generate")
    names = {run_root_limit_name(r, s) for r in ("s3://b/p", "s3://b/q") for s in ("generate", "extract")}
    assert len(names) == 4
    assert all(n.startswith(("eaglescale-generate-", "eaglescale-extract-")) for n in names)


def test_second_holder_of_a_run_root_is_refused_by_name(api_url, tmp_path):
    root = str(tmp_path / "run")
    config = _config(root)
    with run_root_lock(config, "generate") as name:
        assert name == run_root_limit_name(root, "generate")
        busy = _try_lock_in_another_process(api_url, root, "generate")
        assert busy.returncode == 3, busy.stdout + busy.stderr
        assert f"RunRootBusy: generate on run root {root} is held by another run" in busy.stdout
        assert name in busy.stdout
        # Another stage of the same run root, and the same stage elsewhere, are independent.
        with run_root_lock(config, "extract", timeout_s=5), run_root_lock(_config(root + "-b"), "generate", timeout_s=5):
            pass
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
    assert (limit.limit, limit.active_slots) == (1, 0)
    with run_root_lock(config, "generate", timeout_s=5):  # released: the next holder gets it
        pass


def test_an_error_inside_the_lock_is_not_reported_as_busy(api_url, tmp_path):
    config = _config(str(tmp_path / "run"))
    with pytest.raises(TimeoutError) as err, run_root_lock(config, "generate"):
        raise TimeoutError("engine timed out")
    assert type(err.value) is TimeoutError and str(err.value) == "engine timed out"
    with run_root_lock(config, "generate", timeout_s=5):  # released on the way out
        pass


def test_gpu_slots_share_one_limit(api_url, tmp_path):
    with gpu_slots(_config(str(tmp_path)), 8):  # no limit configured: nothing to hold
        pass
    missing = _config(str(tmp_path), gpu_limit="eaglescale-gpu-missing")
    missing_msg = "'eaglescale-gpu-missing' .* does not exist; create it with"
    with pytest.raises(GpuLimitError, match=missing_msg), gpu_slots(missing, 1):
        pass

    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="eaglescale-gpu-test", limit=4))
    config = _config(str(tmp_path), gpu_limit="eaglescale-gpu-test")
    too_many = "asks for 5 GPU slots but limit 'eaglescale-gpu-test' has only 4"
    with pytest.raises(GpuLimitError, match=too_many), gpu_slots(config, 5):
        pass
    with gpu_slots(config, 3):
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name("eaglescale-gpu-test").active_slots == 3
        with pytest.raises(TimeoutError), gpu_slots(config, 2, timeout_s=1):
            pass
        with gpu_slots(config, 1, timeout_s=5):
            pass
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("eaglescale-gpu-test").active_slots == 0
