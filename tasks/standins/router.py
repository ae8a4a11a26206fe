"""A small router with the HTTP surface of SGLang's model gateway (`sglang-router`), over
SGLang-compatible backends: `eaglescale serve-sglang --router URL,URL`.

What the real gateway exposes, and what this one mirrors (sgl-model-gateway docs, "Admin and
Health Endpoints"): `/liveness` and its alias `/health` answer 200 whatever the workers do;
`/readiness` is 200 only while some worker is healthy (503 otherwise); `/health_generate`
runs a generation on a worker; `/workers` lists the workers with `is_healthy` and `load`;
`/get_model_info`, `/server_info`, `/v1/models` come from a worker; `/generate` is forwarded
to one worker (round robin here; cache-aware by default there). Workers are probed with their
`/health` every `health_interval_s`; a worker whose request fails at the transport level is
taken out until its next good probe, and the request is retried on another worker once.
"""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
from aiohttp import web

RETRYABLE_STATUS = (502, 503, 504)


class _Worker:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = False
        self.load = 0


class RouterApp:
    def __init__(self, worker_urls: list[str], health_interval_s: float = 1.0) -> None:
        if not worker_urls:
            raise ValueError("the router needs at least one worker URL")
        self.workers = [_Worker(u) for u in worker_urls]
        self.health_interval_s = health_interval_s
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task[None] | None = None
        self.app = web.Application(client_max_size=512 * 1024**2)
        for path in ("/liveness", "/health"):
            self.app.router.add_get(path, self._liveness)
        self.app.router.add_get("/readiness", self._readiness)
        self.app.router.add_get("/workers", self._list_workers)
        self.app.router.add_post("/generate", self._forward)
        for path in ("/health_generate", "/get_model_info", "/server_info", "/get_server_info", "/v1/models"):
            self.app.router.add_get(path, self._forward)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    async def _start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        await self._probe_all()
        self._prober = asyncio.create_task(self._probe_loop())

    async def _stop(self, _app: web.Application) -> None:
        if self._prober is not None:
            self._prober.cancel()
        if self._session is not None:
            await self._session.close()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self._probe_all()

    async def _probe_all(self) -> None:
        await asyncio.gather(*(self._probe(w) for w in self.workers))

    async def _probe(self, worker: _Worker) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                worker.url + "/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                worker.healthy = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            worker.healthy = False

    def _pick(self, avoid: _Worker | None = None) -> _Worker | None:
        healthy = [w for w in self.workers if w.healthy and w is not avoid]
        return healthy[next(self._rr) % len(healthy)] if healthy else None

    async def _liveness(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _readiness(self, _request: web.Request) -> web.Response:
        healthy = sum(w.healthy for w in self.workers)
        status = 200 if healthy else 503
        return web.json_response(
            {"status": "ready" if healthy else "not ready", "healthy_workers": healthy}, status=status
        )

    async def _list_workers(self, _request: web.Request) -> web.Response:
        workers = [
            {"url": w.url, "is_healthy": w.healthy, "load": w.load, "worker_type": "regular"}
            for w in self.workers
        ]
        stats = {"prefill_count": 0, "decode_count": 0, "regular_count": len(workers)}
        return web.json_response({"workers": workers, "total": len(workers), "stats": stats})

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read() if request.method == "POST" else None
        tried: _Worker | None = None
        last = ""
        for _ in range(2):  # one retry on another worker, as the gateway's retry policy would
            worker = self._pick(avoid=tried)
            if worker is None:
                return _error(503, "no healthy workers available")
            try:
                status, payload, ctype = await self._send(worker, request, body)
            except (aiohttp.ClientError, TimeoutError) as e:
                worker.healthy = False  # until its next good probe
                tried = worker
                last = f"worker {worker.url}: {type(e).__name__}"
                continue
            if status in RETRYABLE_STATUS and tried is None:
                tried = worker
                last = f"worker {worker.url}: HTTP {status}"
                continue
            return web.Response(body=payload, status=status, content_type=ctype)
        return _error(502, last)

    async def _send(
        self, worker: _Worker, request: web.Request, body: bytes | None
    ) -> tuple[int, bytes, str]:
        assert self._session is not None
        worker.load += 1
        try:
            async with self._session.request(
                request.method,
                worker.url + request.path_qs,
                data=body,
                headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
            ) as resp:
                return resp.status, await resp.read(), resp.content_type
        finally:
            worker.load -= 1


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)

