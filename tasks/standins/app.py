"""The aiohttp application of the SGLang-compatible server: handlers, fault application, counters.

Endpoints: POST /generate, GET /health, GET /health_generate, GET /get_model_info, GET /server_info
and the older GET /get_server_info, POST /flush_cache; ours (not SGLang's): POST|GET /_fault,
GET /_stats.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

from aiohttp import web

from tasks.engines.base import SamplingParams
from tasks.engines.sglang_wire import dumps, loads
from tasks.standins.backends import Backend, BackendInput, BackendRequestError
from tasks.standins.faults import HANG_BOUND_S, FaultInjector, FaultSpec
from tasks.standins.server_format import (
    RequestError,
    abort_item,
    error_body,
    parse_generate,
    response_item,
)

# The SGLang release whose /generate answers this server reproduces key for key (recorded from a
# real server: tests/fixtures/sglang-0.5.14/).
SGLANG_COMPAT_VERSION = "0.5.14"
SERVER_VERSION = f"eaglescale-compat/{SGLANG_COMPAT_VERSION}"
HEALTH_GENERATE_TIMEOUT_S = 20.0
_HEALTH_SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=1)

def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def _disconnected(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def _wait_unless_disconnected(request: web.Request, seconds: float) -> None:
    """Sleep up to `seconds`, less when the client goes away first (aiohttp does not cancel
    handlers on disconnect, and a hung handler should not outlive its client)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not _disconnected(request):
        await asyncio.sleep(min(0.05, left))


def _reset_connection(request: web.Request) -> None:
    """Drop the connection with a TCP RST and no response, like a crashed server."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class SGLangCompatServer:
    """The aiohttp application and its state: backend, fault injector, request counters."""

    def __init__(self, backend: Backend, fault: FaultSpec | None = None, skip_tokenizer_init: bool = False) -> None:
        self.backend = backend
        # As SGLang's --skip-tokenizer-init: answers carry no "text" and text input is refused.
        self.skip_tokenizer_init = skip_tokenizer_init
        self.faults = FaultInjector(fault)
        self.requests: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.flushes = 0
        self._health_seq = 0
        self.app = web.Application(client_max_size=64 * 1024**2)
        self.app.router.add_post("/generate", self._generate)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/health_generate", self._health_generate)
        self.app.router.add_get("/get_model_info", self._model_info)
        self.app.router.add_get("/server_info", self._server_info)
        self.app.router.add_get("/get_server_info", self._server_info)
        self.app.router.add_post("/flush_cache", self._flush_cache)
        self.app.router.add_post("/_fault", self._set_fault)
        self.app.router.add_get("/_fault", self._get_fault)
        self.app.router.add_get("/_stats", self._stats)
        self.app.on_cleanup.append(self._on_cleanup)

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.backend.close()

    def _count(self, endpoint: str) -> None:
        self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    async def _apply_fault(self, request: web.Request, mode: str | None) -> web.StreamResponse | None:
        """Carry out the fault drawn for this request: a response to send instead, or None to go
        on (no fault, "slow" after its delay, and "abort", which the handler answers itself)."""
        spec = self.faults.spec
        if mode is None or mode == "abort":
            return None
        if mode == "5xx":
            status = spec.status or 503
            return _json(error_body(f"injected fault: HTTP {status}"), status=status)
        if mode == "reset":
            _reset_connection(request)
            return web.Response(status=500)  # never reaches the client: the transport is gone
        if mode == "timeout":
            await _wait_unless_disconnected(request, spec.delay_s)
            return _json(error_body("injected fault: answered after the timeout"), status=504)
        if mode == "hang":
            await _wait_unless_disconnected(request, HANG_BOUND_S)
            return _json(error_body("injected fault: hung"), status=504)
        await asyncio.sleep(spec.delay_s)  # "slow": the real answer, late
        return None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        self._count("generate")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            mode = self.faults.draw("generate")
            injected = await self._apply_fault(request, mode)
            if injected is not None:
                return injected
            try:
                body = loads(await request.read())
            except ValueError as e:
                return _json(error_body(f"request body is not valid JSON: {e}"), status=400)
            text = not self.skip_tokenizer_init
            try:
                items, batched = parse_generate(body, self._tokenize, self.backend.context_length)
                if mode == "abort":
                    status = self.faults.spec.status or 500
                    out = [abort_item(i, "injected fault: aborted", status, time.perf_counter() - t0, text) for i in items]
                else:
                    outputs = await self.backend.generate(items)
                    dt = time.perf_counter() - t0
                    out = [response_item(i, o, dt, text) for i, o in zip(items, outputs, strict=True)]
            except (RequestError, BackendRequestError) as e:
                return _json(error_body(str(e)), status=400)
            return _json(out if batched else out[0])
        finally:
            self.in_flight -= 1

    def _tokenize(self, text: str) -> list[int]:
        if self.skip_tokenizer_init:
            raise RequestError("this server runs with --skip-tokenizer-init (no tokenizer): send input_ids, not text")
        return self.backend.tokenize(text)

    async def _gate(self, request: web.Request, endpoint: str) -> web.StreamResponse | None:
        """Count a non-generate request and apply a scope="all" fault to it."""
        self._count(endpoint)
        mode = self.faults.draw(endpoint)
        if mode == "abort":
            return web.Response(status=503, text="injected fault: aborted")
        return await self._apply_fault(request, mode)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return await self._gate(request, "health") or web.Response(status=200)

    async def _health_generate(self, request: web.Request) -> web.StreamResponse:
        injected = await self._gate(request, "health_generate")
        if injected is not None:
            return injected
        self._health_seq += 1
        probe = BackendInput(f"HEALTH_CHECK_{self._health_seq}", [1], _HEALTH_SAMPLING)
        try:
            await asyncio.wait_for(self.backend.generate([probe]), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:  # any failure of the probe generation is "unhealthy"
            return web.Response(status=503, text=f"health_generate failed: {type(e).__name__}: {e}")
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.StreamResponse:
        injected = await self._gate(request, "get_model_info")
        if injected is not None:
            return injected
        # SGLang's keys, no more: it reports no vocabulary size here (nor in /server_info).
        path = self.backend.model_path
        return _json({
            "model_path": path, "tokenizer_path": path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
        })  # fmt: skip

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        injected = await self._gate(request, "server_info")
        if injected is not None:
            return injected
        b = self.backend
        info = {
            "model_path": b.model_path,
            "served_model_name": b.model_path,
            "context_length": b.context_length,
            "max_running_requests": b.max_running_requests,
            "max_req_input_len": b.context_length - 1,
            "tp_size": 1,
            "version": SERVER_VERSION,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "eaglescale_backend": b.kind,
        }
        # A backend that emulates launch flags echoes them, as SGLang echoes its server args.
        extra = getattr(b, "server_info_extra", None)
        if extra is not None:
            info.update(extra())
        return _json(info)

    async def _flush_cache(self, request: web.Request) -> web.StreamResponse:
        injected = await self._gate(request, "flush_cache")
        if injected is not None:
            return injected
        self.flushes += 1
        flush = getattr(self.backend, "flush_cache", None)  # a backend that logs like SGLang
        if flush is not None:
            flush()
        return web.Response(status=200, text="Cache flushed.")

    async def _set_fault(self, request: web.Request) -> web.StreamResponse:
        try:
            spec = FaultSpec.from_dict(loads(await request.read()))
        except (ValueError, TypeError) as e:
            return _json(error_body(str(e)), status=400)
        self.faults.configure(spec)
        return _json({"fault": spec.to_dict()})

    async def _get_fault(self, _request: web.Request) -> web.StreamResponse:
        return _json({"fault": self.faults.spec.to_dict()})

    async def _stats(self, _request: web.Request) -> web.StreamResponse:
        return _json(
            {
                "requests": dict(self.requests),
                "generate_requests": self.requests.get("generate", 0),
                "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight,
                "flushes": self.flushes,
                "faults": self.faults.stats(),
                "backend": {"kind": self.backend.kind, **self.backend.stats()},
            }
        )
