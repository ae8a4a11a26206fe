"""An SGLang-compatible HTTP server: SGLang's native endpoints and field names, backed by a local HF
model or a continuous-batching simulator, with runtime-switchable fault injection.

Users dry-run a deployment against it (`eaglescale serve-sglang --simulate`); tests drive the
`sglang` engine through it over real HTTP, on a background thread (`start_server_thread`) or
in a child process (`ServerProcess`, which can be SIGKILLed like a crashed server).
The handlers live in app.py, the backends in backends.py and sim.py (the simulator).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tasks.standins.app import SERVER_VERSION, SGLangCompatServer
from tasks.standins.backends import Backend, ModelBackend
from tasks.standins.faults import FAULT_MODES, FAULT_SCOPES, FaultSpec, FaultSpecError
from tasks.standins.router import RouterApp
from tasks.standins.sim import SimulatedBackend, StepTimes

LISTENING_PREFIX = "listening on "


@dataclass
class ServerOptions:
    model_path: str | None = None  # None: the simulated backend
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port
    step_latency_s: float = 0.02
    max_batch: int = 64
    context_length: int | None = None  # default: the model's, or 32768 when simulated
    vocab_size: int = 32000
    min_new_fraction: float = 0.0  # simulated completions at least this fraction of max_new_tokens
    batch_window_s: float = 0.005
    fault: FaultSpec = field(default_factory=FaultSpec)
    router: list[str] = field(default_factory=list)  # worker URLs: serve as a router instead
    skip_tokenizer_init: bool = False  # as SGLang's flag: no "text" in answers, no text input

    def build_backend(self) -> Backend:
        if self.model_path is not None:
            model = ModelBackend(self.model_path, max_batch=self.max_batch, batch_window_s=self.batch_window_s)
            if self.context_length is not None:
                model.context_length = min(model.context_length, self.context_length)
            return model
        # Each step, prefill or decode, takes step_latency_s: a request of n tokens takes n steps.
        return SimulatedBackend(
            times=StepTimes(prefill_s=self.step_latency_s, decode_s=self.step_latency_s),
            max_batch=self.max_batch,
            context_length=self.context_length or 32768,
            vocab_size=self.vocab_size,
            min_new_fraction=self.min_new_fraction,
        )


async def start_site(server: SGLangCompatServer | RouterApp, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Bind and start; returns the runner (for cleanup) and the base URL with the bound port."""
    # Short shutdown: stopping a test server must not wait for hung handlers.
    runner = web.AppRunner(server.app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{bound_host}:{bound_port}"


class ServerThread:
    """A server on a background thread with its own event loop. `stop()` closes it (idempotent)."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.url = ""
        self.server: SGLangCompatServer | None = None
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sglang-compat-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"SGLang-compatible server failed to start: {self._error}") from self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self.server = SGLangCompatServer(
                self.options.build_backend(), self.options.fault, self.options.skip_tokenizer_init
            )
            self._runner, self.url = self._loop.run_until_complete(
                start_site(self.server, self.options.host, self.options.port)
            )
        except BaseException as e:  # reported to the starting thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server_thread(options: ServerOptions | None = None, **overrides: object) -> ServerThread:
    """Start a server in-process; e.g. `start_server_thread(step_latency_s=0.01, max_batch=8)`."""
    opts = options or ServerOptions()
    for key, value in overrides.items():
        if not hasattr(opts, key):
            raise TypeError(f"start_server_thread: unknown option {key!r}")
        setattr(opts, key, value)
    return ServerThread(opts)


class ServerProcess:
    """A server in a child process (`python -m tasks.standins.server ARGS`).

    `kill()` is a crash (SIGKILL: connections reset, no goodbye); `stop()` a clean shutdown.
    """

    def __init__(self, args: list[str], ready_timeout_s: float = 60.0) -> None:
        repo_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the child)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tasks.standins.server", *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=repo_root,
        )
        try:
            self.url = self._await_url(ready_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _await_url(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if not sel.select(timeout=left):
                    break
                line = self.proc.stdout.readline().decode()
                if line.startswith(LISTENING_PREFIX):
                    return line[len(LISTENING_PREFIX) :].strip()
                if not line:  # EOF: the process exited
                    break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        raise RuntimeError(
            f"SGLang-compatible server did not start (exit code {self.proc.poll()}): {self.stderr()[-2000:]}"
        )

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.kill()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eaglescale serve-sglang",
        description=f"SGLang-compatible HTTP server ({SERVER_VERSION}) for dry runs and tests.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="PATH", help="serve this local HF model folder")
    which.add_argument("--simulate", action="store_true", help="continuous-batching simulator")
    which.add_argument(
        "--router",
        metavar="URL,URL",
        help="route to these SGLang(-compatible) servers with sglang-router's endpoints",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: an ephemeral port (printed)")
    p.add_argument("--step-latency-ms", type=float, default=20.0, help="simulator: time per step")
    p.add_argument("--max-batch", type=int, default=64, help="max running requests (batch)")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=32000, help="simulator: output id range")
    p.add_argument("--batch-window-ms", type=float, default=5.0, help="model: micro-batch window")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help='as SGLang\'s flag: answers carry no "text"; requests must send input_ids')  # fmt: skip
    p.add_argument("--fault", choices=FAULT_MODES, default="none")
    p.add_argument("--fault-rate", type=float, default=1.0, help="fraction of requests (seeded)")
    p.add_argument("--fault-count", type=int, default=None, help="at most this many faults")
    p.add_argument("--fault-delay-s", type=float, default=5.0, help="slow/timeout delay")
    p.add_argument("--fault-status", type=int, default=None, help="5xx: HTTP status; abort: status_code")
    p.add_argument("--fault-scope", choices=FAULT_SCOPES, default="generate")
    p.add_argument("--fault-seed", type=int, default=0)
    return p


def options_from_args(argv: list[str] | None) -> ServerOptions:
    parser = _parser()
    a = parser.parse_args(argv)
    if a.step_latency_ms < 0:
        parser.error(f"--step-latency-ms must be >= 0, got {a.step_latency_ms}")
    if a.max_batch < 1:
        parser.error(f"--max-batch must be >= 1, got {a.max_batch}")
    if a.context_length is not None and a.context_length < 2:
        parser.error(f"--context-length must be >= 2, got {a.context_length}")
    if not 0 <= a.port <= 65535:
        parser.error(f"--port must be 0..65535, got {a.port}")
    fault = FaultSpec(
        a.fault, a.fault_rate, a.fault_count, a.fault_delay_s, a.fault_status, a.fault_scope, a.fault_seed
    )
    try:
        fault.validate()
    except FaultSpecError as e:
        parser.error(str(e).replace("fault spec: ", "--fault-"))
    return ServerOptions(
        model_path=a.model,
        host=a.host,
        port=a.port,
        step_latency_s=a.step_latency_ms / 1000.0,
        max_batch=a.max_batch,
        context_length=a.context_length,
        vocab_size=a.vocab_size,
        batch_window_s=a.batch_window_ms / 1000.0,
        fault=fault,
        router=[u.strip() for u in (a.router or "").split(",") if u.strip()],
        skip_tokenizer_init=a.skip_tokenizer_init,
    )


async def _serve(options: ServerOptions) -> None:
    if options.router:
        server: SGLangCompatServer | RouterApp = RouterApp(options.router)
        about = f"router over {len(options.router)} workers"
    else:
        server = SGLangCompatServer(options.build_backend(), options.fault, options.skip_tokenizer_init)
        b = server.backend
        about = (
            f"backend={b.kind} model={b.model_path} context_length={b.context_length} "
            f"max_running_requests={b.max_running_requests} fault={options.fault.mode}"
        )
    runner, url = await start_site(server, options.host, options.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"{SERVER_VERSION}: {about}", file=sys.stderr, flush=True)
    print(f"{LISTENING_PREFIX}{url}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def serve_main(argv: list[str] | None = None) -> int:
    """`eaglescale serve-sglang`: run until SIGINT/SIGTERM. Returns the exit code."""
    try:
        options = options_from_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(options))
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
