"""What the SGLang-compatible server generates with: the shared backend types and the model backend.

The server (server.py) parses and validates SGLang's request format, then hands a batch of
`BackendInput`s to a backend. Two backends exist: `ModelBackend` here (a local HF model through
`LocalEngine`) and `SimulatedBackend` in sim.py (the simulator, plain or speculative).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from tasks.engines.base import DeadLetter, GenerationRequest, SamplingParams


@dataclass(frozen=True)
class LogprobRequest:
    """A request's return_logprob with its logprob_start_len (resolved: SGLang's -1 is the last
    input token) and top_logprobs_num."""

    start: int
    top_n: int = 0


@dataclass(frozen=True)
class BackendInput:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    logprobs: LogprobRequest | None = None
    sampling_seed: int | None = None  # as sent; SGLang samples with exactly this seed when given


@dataclass
class BackendOutput:
    output_ids: list[int]
    text: str
    finish_reason: dict[str, Any]  # SGLang's object: {"type": "stop", "matched": id} / "length"
    cached_tokens: int = 0
    # Further meta_info fields, e.g. a speculative answer's spec_verify_ct (sim.py).
    meta_extra: dict[str, Any] = field(default_factory=dict)
    # Where a speculative answer first left the plain one (sim.py SpecSim.deviation): (position,
    # the plain token there, FLIP or CHANGE), for the logprobs its own forward reports there.
    deviation: tuple[int, int, str] | None = None


class BackendRequestError(ValueError):
    """The backend refused a request; the server answers HTTP 400 with this message."""


class Backend(Protocol):
    kind: str
    model_path: str
    context_length: int
    max_running_requests: int

    def tokenize(self, text: str) -> list[int]: ...

    async def generate(self, items: list[BackendInput]) -> list[BackendOutput]: ...

    def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def hex_request_id(rid: str) -> str:
    """A hex id for `GenerationRequest`, whose per-request seed parses the first 12 hex digits."""
    if len(rid) >= 12 and all(c in "0123456789abcdef" for c in rid[:12]):
        return rid
    return hashlib.sha256(rid.encode()).hexdigest()


@dataclass
class _Pending:
    item: BackendInput
    future: asyncio.Future[BackendOutput]


@dataclass
class _ModelStats:
    batches: int = 0
    requests: int = 0
    max_batch_seen: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)


class ModelBackend:
    """Serves a local HF model through `LocalEngine.generate_batch`, micro-batching requests.

    Requests that arrive within `batch_window_s` of the first one waiting (up to `max_batch`)
    run as one batch; the model runs on a single executor thread so the event loop keeps
    accepting requests while a batch decodes.
    """

    kind = "model"

    def __init__(
        self,
        model_path: str,
        *,
        max_batch: int = 8,
        batch_window_s: float = 0.005,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        from tasks.engines.local import LocalEngine  # torch is heavy; only this backend needs it

        self.model_path = model_path
        self.engine = LocalEngine(model_path, device=device, dtype=dtype, batch_size=max_batch)
        self.context_length = int(self.engine.context_length)
        self.max_running_requests = max_batch
        self._max_batch = max_batch
        self._window_s = batch_window_s
        self._eos_id = self.engine.tokenizer.eos_token_id
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-model")
        self._queue: asyncio.Queue[_Pending] | None = None
        self._collector: asyncio.Task[None] | None = None
        self._stats = _ModelStats()

    def tokenize(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    async def generate(self, items: list[BackendInput]) -> list[BackendOutput]:
        for item in items:
            if item.ignore_eos:
                raise BackendRequestError("sampling_params.ignore_eos is not supported by the model backend")
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._collector = asyncio.create_task(self._collect_forever())
        loop = asyncio.get_running_loop()
        pending = [_Pending(item, loop.create_future()) for item in items]
        for p in pending:
            self._queue.put_nowait(p)
        return list(await asyncio.gather(*(p.future for p in pending)))

    async def _collect_forever(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self._window_s
            while len(batch) < self._max_batch:
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
            requests = [self._to_request(p.item) for p in batch]
            try:
                outcomes = await loop.run_in_executor(self._executor, self.engine.generate_batch, requests)
            except Exception as e:  # a model failure fails this batch, not the server
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(RuntimeError(f"model backend failed: {e}"))
                continue
            self._record(len(batch))
            for p, outcome in zip(batch, outcomes, strict=True):
                if p.future.done():
                    continue
                if isinstance(outcome, DeadLetter):
                    p.future.set_exception(BackendRequestError(outcome.message))
                else:
                    p.future.set_result(self._to_output(outcome.output_ids, outcome.text, outcome.finish_reason))

    def _to_request(self, item: BackendInput) -> GenerationRequest:
        rid = hex_request_id(item.rid)
        return GenerationRequest(rid, rid, 0, tuple(item.input_ids), item.sampling, item.sampling_seed)

    def _to_output(self, output_ids: list[int], text: str, finish: str) -> BackendOutput:
        if finish == "stop":
            # LocalEngine, like SGLang, ends a stopped output with the stop token it matched.
            matched = output_ids[-1] if output_ids else self._eos_id
            reason: dict[str, Any] = {"type": "stop", "matched": matched}
        else:
            reason = {"type": "length", "length": len(output_ids)}
        return BackendOutput(list(output_ids), text, reason)

    def _record(self, size: int) -> None:
        s = self._stats
        s.batches += 1
        s.requests += size
        s.max_batch_seen = max(s.max_batch_seen, size)
        s.batch_sizes[size] = s.batch_sizes.get(size, 0) + 1

    def stats(self) -> dict[str, Any]:
        s = self._stats
        return {
            "batches": s.batches,
            "requests": s.requests,
            "max_batch_seen": s.max_batch_seen,
            "batch_sizes": {str(k): v for k, v in sorted(s.batch_sizes.items())},
        }

    async def close(self) -> None:
        if self._collector is not None:
            self._collector.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
