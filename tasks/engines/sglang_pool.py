"""Server rotation for the `sglang` engine: slots, least-loaded routing, health and eviction.

Runs entirely on the engine's event loop thread (health() only reads plain fields). A server is
"unknown" until its first /health_generate, "up" (in rotation) or "down". Failures in a row take
it down after `unhealthy_after` (new requests stop; those in flight run to their own end); a health checker then probes it every `health_recheck_s` and puts
it back when the probe passes. A watchdog probes up servers that hold requests but have shown
no progress for a recheck interval, so a hung server is found long before the request timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable

from tasks.config import EngineConfig
from tasks.engines.base import EngineUnavailable, ServerHealth
from tasks.redaction import redact_url

Probe = Callable[["SGLangServer", float], Awaitable[str | None]]


class SGLangServer:
    def __init__(self, url: str, limit: int, kind: str = "server") -> None:
        self.url = url
        self.kind = kind  # "server" | "router" (sglang-router: its limit follows its workers)
        self.limit = limit  # concurrent requests; a router's is set at each probe
        self.workers: int | None = None  # healthy workers behind a router, at its last probe
        self.display = redact_url(url)
        self.generate_url = url + "/generate"
        self.state = "unknown"  # "unknown" | "up" | "down"
        self.in_flight = 0
        self.completed = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.health_checks = 0
        self.last_error = ""
        self.down_since: float | None = None
        self.last_progress = time.monotonic()
        self.checker: asyncio.Task[None] | None = None
        self.kick: asyncio.Event | None = None
        self.verified = False  # its account of its model was checked against the target


class ServerPool:
    def __init__(
        self,
        servers: list[SGLangServer],
        config: EngineConfig,
        probe: Probe,
        health_timeout_s: float,
        unavailable_after_s: float,
    ) -> None:
        self.servers = servers
        self._unhealthy_after = config.unhealthy_after
        self._recheck_s = config.health_recheck_s
        self._retry_probe_s = min(max(config.backoff_base_s, 0.05), config.health_recheck_s)
        self._probe = probe
        self._health_timeout_s = health_timeout_s
        self._unavailable_after_s = unavailable_after_s
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._rr = 0
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False
        self.fatal: BaseException | None = None  # a failure no retry can heal: every acquire raises it

    def capacity(self) -> int:
        """An upper bound on useful concurrent requests (callers size their coroutines by it).
        A router's slots grow and shrink with the workers behind it, learned only when it is
        probed, so with a router the bound is open and its slots alone limit the load."""
        if any(s.kind == "router" for s in self.servers):
            return sys.maxsize
        return sum(s.limit for s in self.servers)

    # -- slots -------------------------------------------------------------------------------

    def _pick(self, avoid: SGLangServer | None) -> SGLangServer | None:
        """The least-loaded up server with a free slot, other than `avoid` when there is one."""
        n = len(self.servers)
        self._rr = (self._rr + 1) % n
        best: SGLangServer | None = None
        for k in range(n):
            s = self.servers[(self._rr + k) % n]
            free = s.state == "up" and s.in_flight < s.limit and s is not avoid
            if free and (best is None or s.in_flight < best.in_flight):
                best = s
        if best is None and avoid is not None and avoid.state == "up" and avoid.in_flight < avoid.limit:
            best = avoid
        return best

    async def acquire(self, avoid: SGLangServer | None, job_started: float) -> SGLangServer:
        """A slot on a server (the caller must `release` it). Raises EngineUnavailable."""
        if self._watchdog is None and not self._closed:
            self._watchdog = asyncio.create_task(self._watch())
        loop = asyncio.get_running_loop()
        while True:
            if self.fatal is not None:
                raise self.fatal
            server = self._pick(avoid)
            if server is not None:
                server.in_flight += 1
                return server
            for s in self.servers:
                if s.state == "unknown":
                    self._ensure_checker(s)
            timeout = self._unavailable_wait(job_started)
            waiter = loop.create_future()
            self._waiters.append(waiter)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, timeout)

    def release(self, server: SGLangServer) -> None:
        server.in_flight -= 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def fail(self, error: BaseException) -> None:
        """Stop every job: a server serves another model (retrying elsewhere could still
        commit its earlier answers' kin; the run stops instead and names it)."""
        if self.fatal is None:
            self.fatal = error
        self._wake_all()

    def _wake_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _unavailable_wait(self, job_started: float) -> float | None:
        """How long a waiter may wait before re-checking; raises once no server was up too long."""
        downs = [s.down_since for s in self.servers]
        if any(d is None for d in downs):
            return None  # some server is up or still being probed
        since = max(max(d for d in downs if d is not None), job_started)
        left = since + self._unavailable_after_s - time.monotonic()
        if left <= 0:
            detail = "; ".join(f"{s.display}: {s.last_error or 'unhealthy'}" for s in self.servers)
            raise EngineUnavailable(
                f"no SGLang server in rotation for {self._unavailable_after_s:g}s ({detail})"
            )
        return left + 0.01

    def job_started(self) -> None:
        """A new generate() call: if every server is down, probe them now rather than later."""
        if all(s.state == "down" for s in self.servers):
            for s in self.servers:
                if s.kick is not None:
                    s.kick.set()

    # -- health ------------------------------------------------------------------------------

    def record_success(self, server: SGLangServer) -> None:
        server.completed += 1
        server.consecutive_failures = 0
        server.last_progress = time.monotonic()

    def record_failure(self, server: SGLangServer, error: str) -> None:
        server.failures += 1
        server.consecutive_failures += 1
        server.last_error = error
        server.last_progress = time.monotonic()
        if server.state == "up" and server.consecutive_failures >= self._unhealthy_after:
            self._take_down(server)
        elif server.state == "unknown":
            server.state, server.down_since = "down", time.monotonic()
            self._wake_all()
        self._ensure_checker(server)

    def _take_down(self, server: SGLangServer) -> None:
        """Out of rotation: no new requests. Its in-flight requests are not cancelled: a server
        failing some requests is usually still answering others, and an answer cancelled on its
        way is generated a second time elsewhere (whole long generations, on a real server).
        Each ends on its own: its answer is used, or its failure (a reset, a 5xx, the request
        timeout for a hung server) retries it elsewhere."""
        server.state, server.down_since = "down", time.monotonic()
        self._wake_all()

    def _mark_up(self, server: SGLangServer) -> None:
        if server.state != "up":
            server.state, server.down_since = "up", None
            server.consecutive_failures = 0
            server.last_progress = time.monotonic()
            self._wake_all()

    def _ensure_checker(self, server: SGLangServer) -> None:
        if server.checker is None and not self._closed:
            server.checker = asyncio.create_task(self._check(server))

    async def _check(self, server: SGLangServer) -> None:
        """Probe until healthy: quickly while it is still up, every recheck interval once down."""
        server.kick = server.kick or asyncio.Event()
        try:
            while not self._closed:
                server.health_checks += 1
                error = await self._probe(server, self._health_timeout_s)
                if error is None:
                    self._mark_up(server)
                    return
                self.record_failure(server, error)
                server.kick.clear()
                wait = self._recheck_s if server.state == "down" else self._retry_probe_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(server.kick.wait(), wait)
        finally:
            server.checker = None

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._recheck_s)
            now = time.monotonic()
            for s in self.servers:
                if s.state == "up" and s.in_flight > 0 and now - s.last_progress > self._recheck_s:
                    self._ensure_checker(s)

    def health(self) -> list[ServerHealth]:
        return [
            ServerHealth(
                url=s.display,
                healthy=s.state == "up",
                in_flight=s.in_flight,
                completed=s.completed,
                failures=s.failures,
                consecutive_failures=s.consecutive_failures,
                last_error=s.last_error,
                extra={
                    "state": s.state,
                    "health_checks": s.health_checks,
                    "kind": s.kind,
                    "limit": s.limit,
                    **({"workers": s.workers} if s.kind == "router" else {}),
                },
            )
            for s in self.servers
        ]

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in [self._watchdog, *(s.checker for s in self.servers)] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
