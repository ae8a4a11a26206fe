"""The Prefect UI in headless Chromium: a real run's page shows the stages and the progress.

A real `prefect server start` serving the UI, a real `eaglescale run` (discover, generate)
against it, then Debian's chromium renders the flow-run pages. The UI is a JS app, so the
assertions are on the DOM after its scripts ran (`--dump-dom` with a virtual-time budget);
the screenshots are kept in the test's tmp_path (pytest keeps the last runs' folders; the
test prints where) for a person to look at, never in the checkout.
"""

from __future__ import annotations

import html
import re
import subprocess
from pathlib import Path

import httpx

from tests.conftest import require_tool
from tests.prefect_support import prefect_server
from tests.run_support import cli_env, start_cli, write_params

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Virtual time stands still while requests are in flight; a second, longer budget covers a
# machine so loaded that the UI's first render did not fit the first one.
BUDGETS_MS = (10_000, 40_000)


def _page_text(dom: str) -> str:
    """The visible text of a DOM dump, whitespace collapsed."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def _render(browser: str, url: str, png: Path, profile: Path, expected: list[str]) -> str:
    """Page text once every expected string shows (or the last try's text), screenshot saved."""
    text = ""
    for budget in BUDGETS_MS:
        out = subprocess.run(
            [
                browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", "--window-size=1600,1000",
                f"--virtual-time-budget={budget}", f"--screenshot={png}", "--dump-dom", url,
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        text = _page_text(out.stdout)
        if all(s in text for s in expected):
            break
    return text


def _runs(api: str) -> tuple[dict, dict[str, dict]]:
    """The parent flow run and its subflow runs by flow name (a fresh server holds only these)."""
    runs = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=30).json()
    flows = {f["id"]: f["name"] for f in httpx.post(f"{api}/flows/filter", json={}, timeout=30).json()}
    parents = [r for r in runs if r["parent_task_run_id"] is None]
    assert len(parents) == 1 and flows[parents[0]["flow_id"]] == "data-scaling", (parents, flows)
    return parents[0], {flows[r["flow_id"]]: r for r in runs if r["parent_task_run_id"]}


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1600, 1000), (width, height)
    # A blank page compresses to a few KB; a rendered run page is tens of KB.
    assert len(data) > 20_000, f"{path} is only {len(data)} bytes: nothing rendered?"


def test_flow_run_page_shows_stage_subflows_and_progress(tmp_path, tiny_target_dir):
    browser = require_tool("chromium", "chromium-browser", install="`make test-tools` installs Debian's chromium")
    params = write_params(
        tmp_path,
        tiny_target_dir,
        str(tmp_path / "run"),
        discover={"total_prompts": 60},
        sampling={"max_new_tokens": 16},
        generate={"shard_size": 20},
        stages=["discover", "generate"],
    )
    (tmp_path / "screenshots").mkdir()
    with prefect_server(tmp_path / "prefect-home", ui=True) as api:
        log = tmp_path / "cli.log"
        rc = start_cli(["run", "--params", str(params)], cli_env(tmp_path, PREFECT_API_URL=api), log).wait(600)
        assert rc == 0, log.read_text()[-3000:]
        parent, subflows = _runs(api)
        assert sorted(subflows) == ["discover", "generate"]
        ui = api.removesuffix("/api")
        # 3.9's default UI is v2 (the server redirects / to /v2/); its tabs are query parameters.
        stages_png = tmp_path / "screenshots/ui-flow-run.png"
        stages = _render(
            browser,
            f"{ui}/v2/runs/flow-run/{parent['id']}?tab=SubflowRuns",
            stages_png,
            tmp_path / "chromium",
            [f"{name} / {run['name']}" for name, run in subflows.items()],
        )
        progress_png = tmp_path / "screenshots/ui-generate-artifacts.png"
        generate = subflows["generate"]
        progress = _render(
            browser,
            f"{ui}/v2/runs/flow-run/{generate['id']}?tab=Artifacts",
            progress_png,
            tmp_path / "chromium",
            ["generate-progress"],
        )
    print(f"UI screenshots: {stages_png} {progress_png}")
    assert parent["name"] in stages and "2 Subflow runs" in stages, stages[:2000]
    assert f"discover / {subflows['discover']['name']}" in stages, stages[:2000]
    assert f"generate / {subflows['generate']['name']}" in stages, stages[:2000]
    assert "PROGRESS generate-progress" in progress, progress[:2000]
    assert f"Generation progress of {tmp_path / 'run'}" in progress, progress[:2000]
    assert f"Parent Run {parent['name']}" in progress, progress[:2000]
    _assert_png(stages_png)
    _assert_png(progress_png)
