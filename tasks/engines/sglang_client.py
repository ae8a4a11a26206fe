"""The `sglang` engine: a client for one or more SGLang servers over native /generate.

One asyncio event loop on a background thread owns all HTTP; `generate()` may be called from
several threads at once (several shard tasks) and they share the per-server concurrency limits
and the health state. Outcomes are handed back to the calling thread, which runs the sink, so a
slow sink never stalls the event loop and a sink that raises stops its own call only.

Failure handling (docs/DESIGN.md §3, generation):
- transport errors (connect error, reset, timeout, 5xx, 408/429, an abort with a 5xx or no
  status): jittered exponential backoff, then a retry on another server when one is free, up to
  `max_attempts`; then the request is requeued once at the end of the call's work, and if that
  round is exhausted too it becomes DeadLetter("transport_exhausted");
- 4xx: DeadLetter("http_<code>"), or "context_overflow" when the message names the context
  length; an abort (HTTP 200) whose status_code is 4xx: DeadLetter("abort_<code>");
- a server is health-checked (/health_generate) before first use and after a failure; after
  `unhealthy_after` failures in a row it leaves rotation (no new requests go to it) and is
  rechecked every `health_recheck_s`. Its in-flight requests are left to finish there: most of
  them are answers on their way, and cancelling them would generate them twice. One that fails
  (reset, 5xx, its own request timeout) is retried elsewhere like any other transport error;
  one that succeeds is delivered, once;
- every HTTP /generate sent counts in the outcome's `attempts`, so callers can report requests
  sent per request;
- with no server in rotation for longer than `unavailable_after_s`, generate() raises
  EngineUnavailable, after the sink has seen every outcome that did finish;
- once `check_servers` gave it the target's needs, a server that says it serves another model
  (at the start, or when it first answers its health check later) or answers an id outside the
  target's vocabulary stops every call with WrongModel; that answer never reaches the sink.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections.abc import Iterable
from typing import Any

import aiohttp

from tasks.config import EngineConfig
from tasks.engines.base import (
    DeadLetter,
    EngineUnavailable,
    GenerationRequest,
    GenerationResult,
    Outcome,
    OutcomeSink,
    ServerHealth,
    ServersUnreachable,
    WrongModel,
)
from tasks.engines.served import ServedModel, TargetNeeds, read_served_model
from tasks.engines.sglang_pool import ServerPool, SGLangServer
from tasks.engines.sglang_wire import (
    MalformedResponse,
    dumps,
    error_message,
    read_generate_reply,
)
from tasks.redaction import redact_url

_RETRYABLE_4XX = frozenset({408, 429})
_DONE = object()


class _Retry(Exception):
    """A transport-level failure of one attempt; the request may be retried."""


class _Item:
    __slots__ = ("index", "request", "payload", "attempts")

    def __init__(self, index: int, request: GenerationRequest) -> None:
        self.index = index
        self.request = request
        self.payload = dumps(
            {
                "input_ids": list(request.input_ids),
                "sampling_params": request.sglang_sampling(),
                "rid": request.request_id,
            }
        )
        self.attempts = 0  # HTTP requests sent for it, over every round


class _Job:
    """One generate() call: its outcomes go to `out`, read by the calling thread."""

    def __init__(self, requests: list[GenerationRequest]) -> None:
        self.items = [_Item(i, r) for i, r in enumerate(requests)]
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.started = time.monotonic()
        self._delivered = bytearray(len(requests))

    def deliver(self, item: _Item, outcome: Outcome) -> None:
        if self._delivered[item.index]:
            raise RuntimeError(f"request {item.request.request_id} produced a second outcome")
        self._delivered[item.index] = 1
        self.out.put(outcome)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class SGLangEngine:
    """Engine over SGLang servers (EngineConfig.endpoints); see the module docstring."""

    name = "sglang"

    def __init__(
        self,
        config: EngineConfig,
        *,
        health_timeout_s: float | None = None,
        unavailable_after_s: float | None = None,
        seed: int | None = None,
    ) -> None:
        if not config.endpoints:
            raise ValueError("engine.endpoints: the sglang engine needs at least one server URL")
        for url in config.endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine.endpoints: {redact_url(url)!r} is not an http:// or https:// URL")
        if len(set(config.endpoints)) != len(config.endpoints):
            dupes = sorted({redact_url(u) for u in config.endpoints if config.endpoints.count(u) > 1})
            raise ValueError(f"engine.endpoints: duplicate URLs {dupes}")
        self.config = config
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._pool = ServerPool(
            [
                SGLangServer(u, config.concurrency_per_server, config.endpoint_kind)
                for u in config.endpoints
            ],
            config,
            probe=self._probe,
            health_timeout_s=health_timeout_s or min(config.request_timeout_s, 30.0),
            unavailable_after_s=unavailable_after_s or 2 * config.health_recheck_s,
        )
        self._session: aiohttp.ClientSession | None = None
        self._jobs: set[asyncio.Future[None]] = set()
        self._closed = False
        self._needs: TargetNeeds | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result()

    async def _open(self) -> None:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            # Our own slot accounting bounds the connections per server; no second limit here.
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s),
            headers={"Content-Type": "application/json"},
            skip_auto_headers=("User-Agent",),
        )

    # -- the calling thread ---------------------------------------------------------------

    def generate(self, requests: Iterable[GenerationRequest], sink: OutcomeSink) -> None:
        if self._closed:
            raise RuntimeError("SGLangEngine.generate: the engine is closed")
        reqs = list(requests)
        seen: set[str] = set()
        for r in reqs:
            if r.request_id in seen:
                raise ValueError(f"SGLangEngine.generate: duplicate request_id {r.request_id!r}")
            seen.add(r.request_id)
        if not reqs:
            return
        job = _Job(reqs)
        fut = asyncio.run_coroutine_threadsafe(self._run_job(job), self._loop)
        fut.add_done_callback(lambda _f: job.out.put(_DONE))
        try:
            while (item := job.out.get()) is not _DONE:
                sink(item)
        except BaseException:
            fut.cancel()
            raise
        try:
            fut.result()
        except asyncio.CancelledError:
            raise EngineUnavailable("SGLangEngine was closed while generate() was running") from None

    def health(self) -> list[ServerHealth]:
        return self._pool.health()

    def check_servers(self, needs: TargetNeeds) -> list[str]:
        """Ask every server what it serves, now: WrongModel for one that cannot serve `needs`,
        ServersUnreachable when none answers. Servers that do not answer yet are checked when
        they first pass a health check, and every answer's ids from now on. Returns notes."""
        self._needs = needs
        found = asyncio.run_coroutine_threadsafe(self._identify_all(), self._loop).result()
        served = [s for s in found.values() if isinstance(s, ServedModel)]
        if not served:
            detail = "; ".join(f"{s.display}: {found[s.url]}" for s in self._pool.servers)
            raise ServersUnreachable(
                f"no generation server answers ({detail}). Fix: start the servers or correct "
                "engine.endpoints (each must answer /get_model_info and /health_generate), then rerun"
            )
        for model in served:
            if problems := needs.problems(model):
                raise WrongModel(needs.refusal(model, problems))
        notes = [n for model in served for n in needs.notes(model)]
        for server in self._pool.servers:
            if isinstance(found[server.url], ServedModel):
                server.verified = True
            else:
                notes.append(f"{server.display} does not answer yet ({found[server.url]}); it is checked when it does")
        return notes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _shutdown(self) -> None:
        for task in list(self._jobs):
            task.cancel()
        await self._pool.close()
        if self._session is not None:
            await self._session.close()

    # -- the event loop -----------------------------------------------------------------------

    async def _run_job(self, job: _Job) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._jobs.add(task)
        try:
            self._pool.job_started()
            requeued = await self._run_round(job, job.items, final=False)
            if requeued:
                await self._run_round(job, requeued, final=True)
        finally:
            self._jobs.discard(task)

    async def _run_round(self, job: _Job, items: list[_Item], final: bool) -> list[_Item]:
        """Run `items` to an outcome each; returns those that exhausted their attempts (not final)."""
        pending = list(reversed(items))
        exhausted: list[_Item] = []

        async def worker() -> None:
            while pending:
                item = pending.pop()
                outcome = await self._run_item(item, job, final)
                if outcome is None:
                    exhausted.append(item)
                else:
                    job.deliver(item, outcome)

        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(min(len(items), self._pool.capacity())):
                    tg.create_task(worker())
        except* (EngineUnavailable, WrongModel) as group:
            raise group.exceptions[0] from None
        exhausted.sort(key=lambda it: it.index)
        return exhausted

    async def _run_item(self, item: _Item, job: _Job, final: bool) -> Outcome | None:
        """Attempts until an outcome; None when this round's attempts ran out and it is not final."""
        tries = 0
        avoid: SGLangServer | None = None
        while True:
            server = await self._pool.acquire(avoid, job.started)
            tries += 1
            item.attempts += 1
            try:
                return await self._attempt(server, item)
            except _Retry as e:
                failure = e
                self._pool.record_failure(server, str(e))
            finally:
                self._pool.release(server)
            if tries >= self.config.max_attempts:
                if not final:
                    return None
                return DeadLetter(
                    item.request.request_id,
                    "transport_exhausted",
                    f"{item.attempts} attempts failed (requeued once); last: {server.display}: {failure}",
                    server=server.display,
                    attempts=item.attempts,
                )
            avoid = server
            await asyncio.sleep(self._backoff(tries))

    def _backoff(self, tries: int) -> float:
        cfg = self.config
        delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (tries - 1))
        return delay * (0.5 + 0.5 * self._rng.random())

    async def _attempt(self, server: SGLangServer, item: _Item) -> Outcome:
        """One HTTP call. Returns a final outcome or raises _Retry."""
        assert self._session is not None
        t0 = time.perf_counter()
        try:
            async with self._session.post(server.generate_url, data=item.payload) as resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _Retry(_describe(e)) from None
        latency = time.perf_counter() - t0
        if status == 200:
            outcome = self._read_ok(server, item, body, latency)
            self._pool.record_success(server)
            return outcome
        message = error_message(body)
        if status >= 500 or status in _RETRYABLE_4XX or status < 400:
            raise _Retry(f"HTTP {status}: {message}")
        self._pool.record_success(server)  # it answered: the server is fine, the request is not
        error_class = f"http_{status}"
        if status == 400 and "context length" in message.lower():
            error_class = "context_overflow"
        return DeadLetter(item.request.request_id, error_class, message, server.display, item.attempts)

    def _read_ok(self, server: SGLangServer, item: _Item, body: bytes, latency: float) -> Outcome:
        try:
            reply = read_generate_reply(body)
        except MalformedResponse as e:
            raise _Retry(str(e)) from None
        wrong = self._needs.out_of_vocabulary(server.display, reply.output_ids) if self._needs else None
        if wrong is not None:
            error = WrongModel(wrong)
            self._pool.fail(error)
            raise error
        rid = item.request.request_id
        if reply.finish == "abort":
            code = reply.abort_status
            if code is not None and 400 <= code < 500:
                return DeadLetter(rid, f"abort_{code}", reply.abort_message, server.display, item.attempts)
            raise _Retry(f"aborted (status_code {code}): {reply.abort_message}")
        return GenerationResult(
            request_id=rid,
            output_ids=reply.output_ids,
            text=reply.text,
            finish_reason=reply.finish,
            prompt_tokens=len(item.request.input_ids) if reply.prompt_tokens is None else reply.prompt_tokens,
            completion_tokens=len(reply.output_ids) if reply.completion_tokens is None else reply.completion_tokens,
            latency_s=latency if reply.e2e_latency is None else reply.e2e_latency,
            server=server.display,
            cached_tokens=reply.cached_tokens,
            attempts=item.attempts,
        )

    async def _probe(self, server: SGLangServer, timeout_s: float) -> str | None:
        """GET /health_generate (a router: /readiness, then /workers): None when healthy,
        else what went wrong."""
        assert self._session is not None
        if server.kind == "router":
            error = await self._probe_router(server, timeout_s)
        else:
            error = await self._probe_server(server, timeout_s)
        if error is None and self._needs is not None and not server.verified:
            return await self._verify(server, self._needs, timeout_s)
        return error

    async def _probe_server(self, server: SGLangServer, timeout_s: float) -> str | None:
        assert self._session is not None
        try:
            async with self._session.get(
                server.url + "/health_generate", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                body = await resp.read()
                if resp.status == 200:
                    return None
                return f"health_generate: HTTP {resp.status}: {error_message(body)}"
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"health_generate: {_describe(e)}"

    async def _verify(self, server: SGLangServer, needs: TargetNeeds, timeout_s: float) -> str | None:
        """A server that came up after the start: what it serves decides whether it joins."""
        found = await self._identify(server, timeout_s)
        if not isinstance(found, ServedModel):
            return found
        if problems := needs.problems(found):
            self._pool.fail(WrongModel(needs.refusal(found, problems)))
            return "serves another model"
        server.verified = True
        return None

    async def _identify_all(self) -> dict[str, ServedModel | str]:
        timeout = min(self.config.connect_timeout_s, self.config.request_timeout_s)
        servers = self._pool.servers
        found = await asyncio.gather(*(self._identify(s, timeout) for s in servers))
        return {s.url: f for s, f in zip(servers, found, strict=True)}

    async def _identify(self, server: SGLangServer, timeout_s: float) -> ServedModel | str:
        """What the server says it serves, or why it did not answer. An endpoint it lacks
        (HTTP 404 from an SGLang-like server) leaves those fields unknown."""
        bodies: list[dict[str, Any]] = []
        for paths in (("/get_model_info",), ("/server_info", "/get_server_info")):
            body: dict[str, Any] = {}
            for path in paths:
                try:
                    async with self._session.get(  # type: ignore[union-attr]
                        server.url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)
                    ) as resp:
                        if resp.status == 404:
                            continue
                        if resp.status >= 500:
                            return f"{path}: HTTP {resp.status}"
                        data = await resp.json(content_type=None) if resp.status == 200 else {}
                except (aiohttp.ClientError, TimeoutError) as e:
                    return f"{path}: {_describe(e)}"
                except ValueError:
                    data = {}
                body = data if isinstance(data, dict) else {}
                break
            bodies.append(body)
        return read_served_model(server.display, bodies[0], bodies[1])

    async def _probe_router(self, server: SGLangServer, timeout_s: float) -> str | None:
        """An sglang-router's /health is liveness only (200 with every worker down), so its
        /readiness decides; /workers then sizes its slots: concurrency_per_server for each
        healthy worker behind it (at least one, when a router does not list them)."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session.get(server.url + "/readiness", timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return f"readiness: HTTP {resp.status}: {error_message(body)}"
            async with self._session.get(server.url + "/workers", timeout=timeout) as resp:
                listing = await resp.json(content_type=None) if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            return f"router probe: {_describe(e)}"
        workers = listing.get("workers") if isinstance(listing, dict) else None
        if isinstance(workers, list):
            server.workers = sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy", True))
            if server.workers == 0:
                return "router lists no healthy workers"
        server.limit = self.config.concurrency_per_server * max(server.workers or 1, 1)
        return None
