"""A continuous-batching timing model of an SGLang server, for dry runs, tests and benchmarks.

Every step takes `step_latency_s` and emits one token for each running request; at most
`max_batch` requests run at once and the rest queue. A request that arrives during a step joins
at the next step boundary, as with a real scheduler. What a request generates depends only on
its rid: the completion length, whether it stops or hits max_new_tokens, and the token ids, so
a benchmark can compute the ideal schedule up front and a test can predict every response.
With `step_latency_s == 0` requests complete immediately (raw HTTP overhead).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tasks.standins.backends import BackendInput, BackendOutput

SIM_EOS_ID = 2
_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,"


@dataclass(frozen=True)
class CompletionPlan:
    n_tokens: int
    finish: str  # "stop" | "length"


def plan_completion(rid: str, max_new_tokens: int, ignore_eos: bool = False) -> CompletionPlan:
    """How long the simulated completion of `rid` is and why it ends.

    The natural length is uniform over 1..2*max_new_tokens, so about half of the requests stop
    early and half are cut at max_new_tokens.
    """
    if max_new_tokens <= 0:
        return CompletionPlan(0, "length")
    if ignore_eos:
        return CompletionPlan(max_new_tokens, "length")
    h = int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "big")
    natural = 1 + h % (2 * max_new_tokens)
    if natural > max_new_tokens:
        return CompletionPlan(max_new_tokens, "length")
    return CompletionPlan(natural, "stop")


def simulated_output(rid: str, plan: CompletionPlan, vocab_size: int) -> BackendOutput:
    """The deterministic output of `rid`: ids from a rid-seeded RNG, the stop token last."""
    rng = random.Random(rid)
    # Ids 0..3 are reserved specials so a generated id never collides with the stop token.
    ids = [4 + rng.randrange(vocab_size - 4) for _ in range(plan.n_tokens)]
    if plan.finish == "stop":
        ids[-1] = SIM_EOS_ID
        reason: dict[str, Any] = {"type": "stop", "matched": SIM_EOS_ID}
        text = "".join(_ALPHABET[i % len(_ALPHABET)] for i in ids[:-1])
    else:
        reason = {"type": "length", "length": plan.n_tokens}
        text = "".join(_ALPHABET[i % len(_ALPHABET)] for i in ids)
    return BackendOutput(ids, text, reason)


class _Running:
    __slots__ = ("item", "plan", "emitted", "future")

    def __init__(self, item: BackendInput, plan: CompletionPlan, future: asyncio.Future[BackendOutput]):
        self.item = item
        self.plan = plan
        self.emitted = 0
        self.future = future


class SimulatedBackend:
    """Continuous batching with a fixed per-step latency and a maximum running batch."""

    kind = "simulated"

    def __init__(
        self,
        *,
        step_latency_s: float = 0.02,
        max_batch: int = 64,
        context_length: int = 32768,
        vocab_size: int = 32000,
        model_path: str = "simulated",
    ) -> None:
        if step_latency_s < 0:
            raise ValueError(f"step_latency_s must be >= 0, got {step_latency_s}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if vocab_size <= 4:
            raise ValueError(f"vocab_size must be > 4, got {vocab_size}")
        self.model_path = model_path
        self.context_length = context_length
        self.max_running_requests = max_batch
        self.step_latency_s = step_latency_s
        self.vocab_size = vocab_size
        self._max_batch = max_batch
        self._waiting: deque[_Running] = deque()
        self._running: list[_Running] = []
        self._wake: asyncio.Event | None = None
        self._stepper: asyncio.Task[None] | None = None
        self._steps = 0
        self._tokens = 0
        self._max_running = 0
        self._max_waiting = 0
        self._late_s = 0.0  # how far step ends fell behind their schedule, summed
        self._restarts = 0  # timeline restarts after falling a whole step behind

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    async def generate(self, items: list[BackendInput]) -> list[BackendOutput]:
        plans = [plan_completion(i.rid, i.sampling.max_new_tokens, i.ignore_eos) for i in items]
        if self.step_latency_s == 0:
            self._tokens += sum(p.n_tokens for p in plans)
            return [simulated_output(i.rid, p, self.vocab_size) for i, p in zip(items, plans, strict=True)]
        if self._stepper is None:
            self._wake = asyncio.Event()
            self._stepper = asyncio.create_task(self._step_forever())
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        entries = [_Running(i, p, loop.create_future()) for i, p in zip(items, plans, strict=True)]
        self._waiting.extend(entries)
        self._max_waiting = max(self._max_waiting, len(self._waiting))
        self._wake.set()
        return list(await asyncio.gather(*(e.future for e in entries)))

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self._max_batch:
            entry = self._waiting.popleft()
            if entry.future.done():  # its handler was cancelled (server shutting down)
                continue
            if entry.plan.n_tokens == 0:
                entry.future.set_result(simulated_output(entry.item.rid, entry.plan, self.vocab_size))
            else:
                self._running.append(entry)
        self._max_running = max(self._max_running, len(self._running))

    async def _step_forever(self) -> None:
        assert self._wake is not None
        deadline = time.monotonic()
        while True:
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                deadline = time.monotonic()
                continue
            # Fixed-rate steps: small lateness does not accumulate; a stall of a whole step
            # restarts the timeline instead of being made up in a burst.
            deadline += self.step_latency_s
            if deadline < time.monotonic():
                deadline = time.monotonic() + self.step_latency_s
                self._restarts += 1
            await asyncio.sleep(deadline - time.monotonic())
            self._late_s += time.monotonic() - deadline
            self._steps += 1
            self._tokens += len(self._running)
            still: list[_Running] = []
            for entry in self._running:
                entry.emitted += 1
                if entry.emitted < entry.plan.n_tokens:
                    still.append(entry)
                elif not entry.future.done():
                    entry.future.set_result(simulated_output(entry.item.rid, entry.plan, self.vocab_size))
            self._running = still

    def stats(self) -> dict[str, Any]:
        return {
            "step_latency_s": self.step_latency_s,
            "max_batch": self._max_batch,
            "steps": self._steps,
            "tokens": self._tokens,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "max_running": self._max_running,
            "max_waiting": self._max_waiting,
            "late_s": self._late_s,
            "timeline_restarts": self._restarts,
        }

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
        for entry in [*self._running, *self._waiting]:
            if not entry.future.done():
                entry.future.cancel()
