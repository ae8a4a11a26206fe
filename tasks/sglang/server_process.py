"""Launch an SGLang server (or the emulator), wait until it serves, check what it says it is,
and read its log: CUDA-graph captures and `Decode batch` lines.

The launcher is injectable: `SGLangLauncher` runs `python -m sglang.launch_server` on a GPU
node; `EmulatedLauncher` runs tasks.standins.spec_launch with the same arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from tasks.errors import ExpectedFailure
from tasks.sglang.command import LaunchSpec, build_launch_command, build_server_args
from tasks.sglang.versions import GRPC_PORT_OFFSET, flag_set

LOG_TAIL_LINES = 40


class ServerStartError(RuntimeError, ExpectedFailure):
    """The server exited or never became healthy; the message ends with its log tail."""


class Launcher(Protocol):
    version: str

    def command(self, spec: LaunchSpec) -> list[str]: ...

    def env(self) -> dict[str, str]: ...


@dataclass
class SGLangLauncher:
    """Production: `python -m sglang.launch_server ARGS` for a pinned SGLang version."""

    version: str
    python: str = "python"

    def command(self, spec: LaunchSpec) -> list[str]:
        return build_launch_command(spec, self.version, self.python)

    def env(self) -> dict[str, str]:
        return {}


@dataclass
class EmulatedLauncher:
    """CI and dry runs: the package's SGLang emulator, given exactly SGLang's arguments.

    `sim` holds EmulatorConfig fields (tasks/standins/spec_launch.py); each launch gets the next
    launch index, which seeds its emulated speed factor (run-to-run spread). A draft folder whose
    config.json has an `eaglescale_emulator` object overrides `sim` with it for its launches: how
    good a draft is belongs to the draft, so a gate can measure drafts of different acceptance
    side by side (SGLang ignores the key)."""

    version: str
    sim: dict[str, Any] = field(default_factory=dict)
    python: str = sys.executable
    launches: int = 0

    def command(self, spec: LaunchSpec) -> list[str]:
        sim = {**self.sim, **draft_emulation(spec), "sglang_version": flag_set(self.version).version}
        index = self.launches
        self.launches += 1
        return [
            self.python, "-m", "tasks.standins.spec_launch",
            "--sim-config-json", json.dumps(sim), "--sim-launch-index", str(index),
            *build_server_args(spec, self.version),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        root = str(Path(__file__).resolve().parents[2])
        return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


EMULATION_KEY = "eaglescale_emulator"


def draft_emulation(spec: LaunchSpec) -> dict[str, Any]:
    """The emulator settings a draft folder carries in its config.json (see EmulatedLauncher)."""
    if spec.spec is None:
        return {}
    path = Path(spec.spec.draft_model_path) / "config.json"
    try:
        overrides = json.loads(path.read_text()).get(EMULATION_KEY) or {}
    except (OSError, ValueError, AttributeError):
        return {}  # no readable config: the emulator's own defaults (preflight has said why)
    return dict(overrides)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _draw_port(rng: random.Random, host: str, low: int, high: int, taken: set[int] | None = None,
               twin: int | None = None) -> int:  # fmt: skip
    """A random port in [low, high] that binds now and is not in `taken`; with `twin`, port + twin too."""
    taken = taken or set()
    for _ in range(500):
        port = rng.randint(low, high)
        wanted = [port] if twin is None else [port, port + twin]
        if all(p not in taken and _bindable(host, p) for p in wanted):
            return port
    raise OSError(f"no free port in {low}..{high} on {host}" + (f" ({len(taken)} taken by this gate)" if taken else ""))


def free_port(host: str = "127.0.0.1", max_port: int = 65535 - GRPC_PORT_OFFSET, low: int = 20000) -> int:
    """A port that is free now, random in [low, max_port]. The default ceiling suits every
    pinned SGLang version: 0.5.14 also opens port + 10000 (gRPC) and refuses to start when that
    passes 65535."""
    return _draw_port(random.Random(), host, low, max_port)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (Linux: ip_local_port_range)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


class PortPool:
    """The ports of one gate's servers: each launch's HTTP port (and the gRPC port 0.5.14 opens at
    port + GRPC_PORT_OFFSET) and its NCCL port (`--nccl-port`, torch.distributed's store), all
    distinct, bindable when handed out, and below the kernel's ephemeral range where there is room.

    Left to itself SGLang takes its NCCL port from a port-0 bind that it releases and binds again
    later, so servers starting together (or any other process) can be handed the same port in
    between: one of ten SGLang 0.5.14 servers starting at once died with EADDRINUSE on it before
    serving (BENCHMARKS P8). Neither port-0 binds nor outgoing connections are handed a
    port below the ephemeral range."""

    def __init__(self, host: str = "127.0.0.1", low: int = 20000, ephemeral: tuple[int, int] | None = None) -> None:
        self.host = host
        below = (ephemeral or ephemeral_range())[0] - 1  # the highest port under the ephemeral range
        if below - low >= GRPC_PORT_OFFSET + 1000:  # room for HTTP ports whose gRPC port stays below too
            self.http, self.nccl = (low, below - GRPC_PORT_OFFSET), (low, below)
        else:  # an unusual range: any port the versions allow, checked free
            self.http, self.nccl = (low, 65535 - GRPC_PORT_OFFSET), (low, 65535)
        self.taken: set[int] = set()
        self._rng = random.Random()

    def _draw(self, span: tuple[int, int], twin: int | None = None) -> int:
        port = _draw_port(self._rng, self.host, *span, self.taken, twin)
        self.taken.update([port] if twin is None else [port, port + twin])
        return port

    def http_port(self) -> int:
        return self._draw(self.http, GRPC_PORT_OFFSET)

    def nccl_port(self) -> int:
        return self._draw(self.nccl)


@dataclass
class LaunchedServer:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    spec: LaunchSpec

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group (SGLang forks schedulers), then SIGKILL."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def launch(launcher: Launcher, spec: LaunchSpec, log_path: Path) -> LaunchedServer:
    """Start the server with stdout and stderr in `log_path`, env = ours + launcher's + spec's."""
    command = launcher.command(spec)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **launcher.env(), **spec.env}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return LaunchedServer(proc, f"http://{spec.host}:{spec.port}", log_path, spec)


def wait_healthy(
    server: LaunchedServer, client: httpx.Client, timeout_s: float, poll_s: float = 1.0
) -> float:
    """Seconds until /health_generate answered 200. Raises ServerStartError (with the log
    tail) when the process exits first or the timeout passes; the server is stopped then."""
    t0 = time.monotonic()
    last = "no answer yet"
    while True:
        code = server.proc.poll()
        if code is not None:
            server.stop()
            raise ServerStartError(
                f"SGLang server {server.url} exited with code {code} before becoming healthy; "
                f"log tail ({server.log_path}):\n{server.log_tail()}"
            )
        try:
            r = client.get(server.url + "/health_generate", timeout=max(poll_s, 5.0))
            if r.status_code == 200:
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        if time.monotonic() - t0 > timeout_s:
            server.stop()
            raise ServerStartError(
                f"SGLang server {server.url} not healthy after {timeout_s:g} s (/health_generate: "
                f"{last}); log tail ({server.log_path}):\n{server.log_tail()}"
            )
        time.sleep(poll_s)


def fetch_server_info(client: httpx.Client, url: str, version: str) -> dict[str, Any]:
    """Server info, from whichever of /server_info and /get_server_info the version serves;
    SGLang's server args are flattened into it (a nested "server_args" is merged)."""
    for path in flag_set(version).server_info_paths:
        r = client.get(url + path, timeout=30.0)
        if r.status_code == 404:
            continue
        r.raise_for_status()
        info = r.json()
        nested = info.get("server_args")
        return {**nested, **info} if isinstance(nested, dict) else info
    raise ServerStartError(f"{url} serves neither /server_info nor /get_server_info")


def _expected_info(spec: LaunchSpec) -> dict[str, Any]:
    s = spec.spec
    expected: dict[str, Any] = {"speculative_algorithm": s.algorithm if s else None}
    if s is not None:
        expected.update(
            speculative_draft_model_path=s.draft_model_path,
            speculative_num_steps=s.num_steps,
            speculative_eagle_topk=s.topk,
            speculative_num_draft_tokens=s.num_draft_tokens,
        )
    if spec.adaptive_config is not None:  # 0.5.14 turns it off (with a log line) where it cannot adapt
        expected["speculative_adaptive"] = True
    return expected


def check_server_info(info: dict[str, Any], spec: LaunchSpec) -> list[str]:
    """Where the server's own account of itself differs from what was launched. A key the
    server does not report cannot differ: `unreported_server_info` lists those."""
    problems = []
    for key, want in _expected_info(spec).items():
        if key in info and info[key] != want:
            problems.append(f"server info {key} is {info[key]!r}, expected {want!r}")
    for key in ("disable_cuda_graph", "disable_decode_cuda_graph"):
        if key in info and bool(info[key]) != spec.disable_cuda_graph:
            problems.append(f"server info {key} is {info[key]!r}, expected {spec.disable_cuda_graph!r}")
    return problems


def unreported_server_info(info: dict[str, Any], spec: LaunchSpec) -> list[str]:
    """The launch settings the server's info does not mention, so nothing confirms them there
    (speculation still shows in spec_verify_ct and the draft's CUDA-graph captures)."""
    return [f"server info has no {key}" for key in _expected_info(spec) if key not in info]


# Two wordings: "Capture cuda graph begin" / "Capture draft [extend ]cuda graph begin" (0.5.4 era)
# and "Capture target verify|decode CUDA graph begin", "Capture draft decode|extend CUDA graph
# begin", "Capture target prefill CUDA graph begin" (newer model_runner cuda_graph_setup).
_CAPTURE = re.compile(r"Capture (?P<what>(?:[a-z]+ )*?)(?:cuda|cpu|npu|xpu) graph (?P<phase>begin|end)\b", re.I)
_DECODE = re.compile(r"Decode batch\b")
_ACCEPT = re.compile(r"accept len: ([0-9.]+)")
_GRAPH = re.compile(r"\b(?:cuda|cpu|npu|xpu|musa) graph: (True|False)", re.I)
_THROUGHPUT = re.compile(r"gen throughput \(token/s\): ([0-9.]+)")
_FLUSHED = re.compile(r"Cache flushed successfully")
_CAPTURE_KINDS = ("target", "draft", "draft_extend", "prefill")
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]")
# A launch's start-up as SGLang 0.5.14's log tells it, each the time of its first line (its last
# for the loads and captures, which come once for the target and again for a draft): the server
# process's arguments, the scheduler process's first line, the weights loaded, the CUDA graphs
# captured, ready. Launches of Qwen2.5-Coder-1.5B were ready after 61-81 s, ~50 s of them before
# the scheduler's first line: the two processes starting, not the model (BENCHMARKS P31).
_STARTUP = (
    ("server_args", re.compile(r"server_args=ServerArgs\("), "first"),
    ("scheduler", re.compile(r"Init torch distributed begin"), "first"),
    ("weights_loaded", re.compile(r"Load weight end"), "last"),
    ("graphs_captured", re.compile(r"Capture .*graph end\b", re.I), "last"),
    ("ready", re.compile(r"The server is fired up and ready"), "first"),
)


def _capture_kind(what: str) -> str:
    words = what.lower().split()
    if "prefill" in words or "piecewise" in words:
        return "prefill"  # prefill graphs are not what decode speed depends on; recorded only
    if words[:1] == ["draft"]:
        return "draft_extend" if "extend" in words else "draft"
    return "target"  # "", "target verify" (speculative) or "target decode" (baseline)


@dataclass
class DecodeLine:
    accept_len: float | None
    cuda_graph: bool | None
    gen_throughput: float | None


def _stamp(line: str) -> float | None:
    """A log line's time (SGLang writes the machine's local time, to the second), as epoch seconds."""
    m = _STAMP.match(line)
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) if m else None


@dataclass
class LogReport:
    captures: dict[str, dict[str, int]]  # kind -> {"begin": n, "end": n}
    decode: list[DecodeLine]
    cache_flushes: int = 0
    # epoch seconds of the first timestamped line ("first_line") and of each _STARTUP phase found
    startup_at: dict[str, float] = field(default_factory=dict)

    def startup_s(self, started_at: float) -> dict[str, float]:
        """Each start-up phase in seconds after the launch began (`started_at`, epoch): to the
        second, as the log's times are."""
        return {k: round(t - started_at, 1) for k, t in self.startup_at.items()}

    def graph_problems(self, speculative: bool, num_steps: int = 0) -> list[str]:
        """What is missing for a CUDA-graph benchmark: the target (verify) graph, the draft
        graphs (SGLang captures the multi-step draft graph only for num_steps > 1), and decode
        batches that ran on graphs."""
        kinds = ["target"] + (["draft_extend"] + (["draft"] if num_steps > 1 else []) if speculative else [])
        problems = []
        for kind in kinds:
            c = self.captures[kind]
            if c["begin"] == 0 and c["end"] == 0:
                problems.append(f"no {kind.replace('_', ' ')} CUDA-graph capture in the server log")
            elif c["end"] < c["begin"]:
                problems.append(f"{kind.replace('_', ' ')} CUDA-graph capture began but never ended")
        flags = [d.cuda_graph for d in self.decode if d.cuda_graph is not None]
        if flags and not any(flags):
            problems.append(f"all {len(flags)} decode log lines say cuda graph: False")
        return problems

    def to_dict(self, started_at: float | None = None) -> dict[str, Any]:
        accepts = [d.accept_len for d in self.decode if d.accept_len is not None]
        graphs = [d.cuda_graph for d in self.decode if d.cuda_graph is not None]
        return {
            "captures": self.captures,
            "decode_lines": len(self.decode),
            "decode_cuda_graph_true": sum(1 for g in graphs if g),
            "mean_logged_accept_len": sum(accepts) / len(accepts) if accepts else None,
            "cache_flushes": self.cache_flushes,
            **({"startup_s": self.startup_s(started_at)} if started_at is not None and self.startup_at else {}),
        }


def parse_server_log(text: str) -> LogReport:
    captures = {kind: {"begin": 0, "end": 0} for kind in _CAPTURE_KINDS}
    decode = []
    flushes = 0
    startup: dict[str, float] = {}
    for line in text.splitlines():
        if "ready" not in startup:  # the start-up's lines all come before it
            at = _stamp(line)
            if at is not None:
                startup.setdefault("first_line", at)
                for name, pattern, which in _STARTUP:
                    if (which == "last" or name not in startup) and pattern.search(line):
                        startup[name] = at
        if _FLUSHED.search(line):
            flushes += 1
            continue
        m = _CAPTURE.search(line)
        if m:
            captures[_capture_kind(m.group("what"))][m.group("phase").lower()] += 1
            continue
        if _DECODE.search(line):
            a, g, t = _ACCEPT.search(line), _GRAPH.search(line), _THROUGHPUT.search(line)
            decode.append(
                DecodeLine(
                    float(a.group(1)) if a else None,
                    (g.group(1) == "True") if g else None,
                    float(t.group(1)) if t else None,
                )
            )
    return LogReport(captures, decode, flushes, startup)
