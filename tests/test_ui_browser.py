"""The Prefect UI in headless Chromium, where the people watching a run look: the parent run's
summary, the stage graph, and generation's live progress while it runs.

A real `prefect server start` serving the UI, a real `eaglescale run` (the whole DAG) against it,
then Debian's chromium renders the flow-run pages. The UI is a JS app, so the
assertions are on the DOM after its scripts ran (`--dump-dom` with a virtual-time budget);
the screenshots are kept in the test's tmp_path (pytest keeps the last runs' folders; the
test prints where) for a person to look at, never in the checkout.
"""

from __future__ import annotations

import html
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from flows.views import PROGRESS_TABLE_KEY, RUN_SUMMARY_KEY
from tasks.standins.server import ServerProcess
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


def _artifact(api: str, key: str) -> dict | None:
    """The newest artifact of `key` (a fresh server holds this run's only)."""
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": [key]}}}, timeout=30).json()
    return found[-1] if found else None


def _live_requests(api: str) -> tuple[int, int] | None:
    """(done, total) as generation's live view shows them now; None before it exists."""
    art = _artifact(api, PROGRESS_TABLE_KEY)
    m = re.search(r"\| requests \| ([\d,]+) / ([\d,]+) ", (art or {}).get("data") or "")
    return (int(m[1].replace(",", "")), int(m[2].replace(",", ""))) if m else None


def _pause_mid_generation(api: str, server: ServerProcess, run: Any) -> tuple[int, int]:
    """Once the live view shows some requests done and more to go, stop the generation server
    (SIGSTOP: its requests wait, nothing fails) and wait for the view to settle; (done, total)."""
    deadline = time.monotonic() + 300
    while (seen := _live_requests(api)) is None or not 0 < seen[0] < seen[1]:
        assert run.poll() is None and time.monotonic() < deadline, f"generation never seen mid-way: {seen}"
        time.sleep(0.2)
    os.kill(server.proc.pid, signal.SIGSTOP)
    time.sleep(3)  # requests already answered are journaled; the view is rewritten every second
    settled = _live_requests(api)
    assert settled is not None and 0 < settled[0] < settled[1], settled
    return settled


def _edges(api: str, parent_id: str) -> set[tuple[str, str]]:
    """The run graph's edges between stages (flow names), as the UI's graph draws them."""
    graph = httpx.get(f"{api}/flow_runs/{parent_id}/graph-v2", timeout=30).json()
    label = {node_id: node["label"].split(" / ")[0] for node_id, node in graph["nodes"]}
    return {(label[p["id"]], label[node_id]) for node_id, node in graph["nodes"] for p in node["parents"]}


def _last_own_line(api: str, parent_id: str) -> str:
    """The parent run's last log line before Prefect's own `Finished in state ...`."""
    body = {"logs": {"flow_run_id": {"any_": [parent_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
    lines = [r["message"] for r in httpx.post(f"{api}/logs/filter", json=body, timeout=30).json()]
    return [line for line in lines if not line.startswith("Finished in state")][-1]


def test_a_watcher_sees_the_story_the_stage_graph_and_live_progress(tmp_path, tiny_target_dir):
    """The whole DAG against a real server with its UI, generation on a stand-in SGLang server
    the test pauses mid-way: the generate run's page shows the live figures at that moment, the
    parent's first page its summary (each stage, its clock and numbers, the decision), the graph
    discover -> generate -> extract -> train -> gate, and the parent's last log line is words."""
    browser = require_tool("chromium", "chromium-browser", install="`make test-tools` installs Debian's chromium")
    # Every answer 0.3 s late ("slow": the real answer): 60 requests at 4 in flight take ~5 s, so
    # the live view, rewritten every second, is seen mid-way before the test pauses the server.
    server = ServerProcess(["--model", str(tiny_target_dir), "--fault", "slow", "--fault-delay-s", "0.3"])
    params = write_params(
        tmp_path, tiny_target_dir, str(tmp_path / "run"),
        discover={"total_prompts": 60}, sampling={"max_new_tokens": 16},
        engine={"kind": "sglang", "endpoints": [server.url], "concurrency_per_server": 4, "request_timeout_s": 600},
        generate={"shard_size": 20, "max_parallel_shards": 1, "progress_interval_s": 1},
        train={"max_steps": 60, "eval_every": 30, "save_every": 30},
        gate={"num_steps": [1], "repetitions": 2, "num_prompts": 4, "max_new_tokens": 16, "n_bootstrap": 200},
    )  # fmt: skip
    shots, profile = tmp_path / "screenshots", tmp_path / "chromium"
    shots.mkdir()
    try:
        with prefect_server(tmp_path / "prefect-home", ui=True) as api:
            ui = api.removesuffix("/api")
            log = tmp_path / "cli.log"
            env = cli_env(tmp_path, PREFECT_API_URL=api, PREFECT_LOGGING_LEVEL="INFO")
            run = start_cli(["run", "--params", str(params)], env, log)
            done, total = _pause_mid_generation(api, server, run)
            live_view = _artifact(api, PROGRESS_TABLE_KEY)
            live = _render(browser, f"{ui}/v2/artifacts/artifact/{live_view['id']}", shots / "ui-generate-live.png",
                           profile, [f"{done} / {total}"])  # fmt: skip
            os.kill(server.proc.pid, signal.SIGCONT)
            assert run.wait(600) == 0, log.read_text()[-3000:]
            parent, subflows = _runs(api)
            # The parent's page: the stage graph on top (the screenshot), its Artifacts tab below.
            page = _render(browser, f"{ui}/v2/runs/flow-run/{parent['id']}?tab=Artifacts", shots / "ui-parent.png",
                           profile, [RUN_SUMMARY_KEY])  # fmt: skip
            summary_view = _artifact(api, RUN_SUMMARY_KEY)
            summary = _render(browser, f"{ui}/v2/artifacts/artifact/{summary_view['id']}", shots / "ui-run-summary.png",
                              profile, ["Finished"])  # fmt: skip
            edges, last_line = _edges(api, parent["id"]), _last_own_line(api, parent["id"])
            report = _artifact(api, "gate-report")["data"]
    finally:
        server.stop()
    print(f"UI screenshots: {sorted(p.name for p in shots.iterdir())} in {shots}")
    assert sorted(subflows) == ["discover", "extract", "gate", "generate", "train"]
    # Mid-run, the generate run's page showed the live figures, at the paused count.
    assert f"{done} / {total}" in live and "tok/s" in live and "dead letters" in live, live[:3000]
    # The parent's first page: its summary, where the run ended and what it decided.
    assert RUN_SUMMARY_KEY in page and "did not produce any artifacts" not in page, page[:3000]
    assert summary_view["flow_run_id"] == parent["id"]
    assert re.search(r"Finished: (PROMOTED|REJECTED, not promoted|STOPPED, not promoted)", summary), summary[:3000]
    final = summary_view["data"]
    for stage in subflows:  # a row per stage: completed, its clock, a link to its own run
        row = next(line for line in final.splitlines() if line.startswith(f"| {stage} |"))
        assert "completed" in row and f"runs/flow-run/{subflows[stage]['id']}" in row, row
        assert f"{stage} / {subflows[stage]['name']}" in summary  # the link, as the page shows it
    assert "60 / 60 requests" in summary and "Decision:" in summary
    # The graph: the pipeline's order and nothing else.
    assert edges == {("discover", "generate"), ("generate", "extract"), ("extract", "train"), ("train", "gate")}, edges
    assert last_line.startswith("data-scaling finished in ") and "{" not in last_line, last_line
    # The gate's report fits the page: no table wider than six columns (report.md keeps its own).
    widths = [len(re.split(r"(?<!\\)\|", line.strip())) - 2 for line in report.splitlines() if line.startswith("|")]
    assert widths and max(widths) <= 6, max(widths)
    for png in shots.iterdir():
        _assert_png(png)
