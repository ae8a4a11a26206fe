"""The temporary Prefect API of one `eaglescale run` without PREFECT_API_URL, which never
outlives the run.

Prefect's own ephemeral mode (`SubprocessASGIServer`) starts uvicorn as a plain child and stops
it at exit: Ctrl-C to the terminal's process group killed it together with the run (whose last
API calls, reporting the crash, then retried for minutes and ended in a ConnectError), and a
kill -9 or SIGTERM of the run, which runs no exit handler, left it holding its port and ~200 MB.

This one is the same server (uvicorn serving `prefect.server.api.server:create_app`, with the
settings Prefect gives its ephemeral server), started in its own session, so a terminal's
signals reach only eaglescale, which stops it last, once the run's final states are reported;
and it reads a pipe from eaglescale: however eaglescale dies, the kernel closes that pipe, and
the server exits. `python -m flows.temporary_api PORT` is the server's side.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

# A shutdown that has not ended after this long is cut short (os._exit).
SHUTDOWN_GRACE_S = 3.0


class TemporaryApiError(RuntimeError):
    """The temporary Prefect API did not start."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:  # noqa: S310 - loopback
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class TemporaryApi:
    """A started server: `url` is its API URL; `stop()` ends it (idempotent)."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def stop(self) -> None:
        _drain_clients()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the server's cue to shut down
        try:
            self.proc.wait(timeout=SHUTDOWN_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _drain_clients() -> None:
    """Send this process's queued flow-run logs and events now, while the API still answers
    (Prefect would at exit, and print "Error logging to API" with the API gone)."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)


def start(timeout_s: float, attempts: int = 3, meanwhile: Callable[[], object] | None = None) -> TemporaryApi:
    """Start the server on a free loopback port and wait until it answers /health.

    `meanwhile` runs once, while the first server starts: the caller's own imports, say, so that
    they and the server's start-up (~10 s of a core each on a 2-core box) take the two cores at
    once. `timeout_s` counts from its end; if it raises, the server is stopped."""
    env = {
        **os.environ,
        # What Prefect's ephemeral server runs with: no UI, ephemeral-server settings.
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        # A throw-away server has nothing to report, and offline its report is an ERROR line
        # that opens every run ("Failed to send telemetry"); a user's explicit setting stands.
        "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    }
    env.pop("PREFECT_API_URL", None)
    last = ""
    for attempt in range(attempts):  # a port taken between choosing and binding it: choose again
        port = _free_port()
        url = f"http://127.0.0.1:{port}/api"
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.temporary_api", str(port)],
            stdin=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        if attempt == 0 and meanwhile is not None:
            try:
                meanwhile()
            except BaseException:
                TemporaryApi(proc, url).stop()
                raise
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if _healthy(url):
                return TemporaryApi(proc, url)
            time.sleep(0.1)
        api = TemporaryApi(proc, url)
        api.stop()
        last = f"exited with code {proc.returncode}" if proc.returncode else f"not healthy after {timeout_s:g} s"
    raise TemporaryApiError(
        f"the temporary Prefect API {last}; set PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS "
        "higher, or run `prefect server start` and set PREFECT_API_URL"
    )


def _serve(port: int) -> None:
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            "prefect.server.api.server:create_app",
            factory=True,
            host="127.0.0.1",
            port=port,
            log_level="error",
            lifespan="on",
        )
    )

    def exit_with_parent() -> None:
        with contextlib.suppress(OSError):
            sys.stdin.buffer.read()  # returns at EOF: eaglescale closed the pipe, or died
        # The run's states and logs are in (TemporaryApi.stop drains them first): no need to
        # wait for the run's idle keep-alive connections or background tasks.
        server.should_exit = True
        time.sleep(SHUTDOWN_GRACE_S)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True, name="exit-with-parent").start()
    server.run()
    # uvicorn may have failed to bind (exit code 1): say so through the exit code.
    sys.exit(0 if server.started else 3)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
