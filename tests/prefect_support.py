"""A real `prefect server start` on loopback for tests that run the CLI many times."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.run_support import child_env, migrated_prefect_home
from tests.s3_support import free_port


@contextmanager
def prefect_server(home: Path, ui: bool = False) -> Iterator[str]:
    """Yields the API URL; the server (SQLite under `home`) stops when the block exits.

    With `ui`, the server also serves the UI at the URL without `/api`; the UI's bundle is
    copied under `home` (the default place is inside the installed package, shared by every
    test run at once) and told the API's real port (it would assume 4200).
    """
    migrated_prefect_home(home)  # a copy of the session's migrated database, unless it has one
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = child_env()  # no host Slack/AWS/Prefect values
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="true" if ui else "false",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    if ui:
        env.update(PREFECT_UI_API_URL=url, PREFECT_UI_STATIC_DIRECTORY=str(home / "ui-build"))
    env.pop("PREFECT_API_URL", None)
    log = open(home.parent / f"prefect-server-{port}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"prefect server did not become healthy in 120 s; see {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
