"""The engine interface every generation backend implements.

An engine takes prompts already tokenized with the target's chat template and streams back one
outcome per request: a `GenerationResult` or a `DeadLetter`. Retries of transport errors happen
inside the engine; what comes out is final for that request in this attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tasks.errors import ExpectedFailure

if TYPE_CHECKING:
    from tasks.engines.served import TargetNeeds


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    seed: int = 0

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` object of SGLang's native /generate."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_id: str
    sample_index: int
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    # The seed a server was sent (SGLang's sampling_seed), which then is the request's seed;
    # None: derived from the request id (what our engines and clients send).
    fixed_seed: int | None = None

    def seed(self) -> int:
        """Per-request seed: sampled outputs do not depend on batch composition or order, and a
        request sent again (a resume, another server) draws the same sample."""
        if self.fixed_seed is not None:
            return self.fixed_seed & 0x7FFFFFFF
        return (int(self.request_id[:12], 16) ^ self.sampling.seed) & 0x7FFFFFFF

    def sglang_sampling(self) -> dict[str, Any]:
        """The `sampling_params` of SGLang's /generate for this request: a sampled request carries
        its seed (`sampling_seed`), so a server that honours it (SGLang with
        --enable-deterministic-inference) draws what the in-process engine draws. A greedy one
        needs none and sends none."""
        params = self.sampling.to_sglang()
        if self.sampling.temperature > 0:
            params["sampling_seed"] = self.seed()
        return params


@dataclass
class GenerationResult:
    request_id: str
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    server: str = ""
    cached_tokens: int = 0
    attempts: int = 1  # requests sent for it (an HTTP engine's retries count), as DeadLetter's

    def to_record(self) -> dict[str, Any]:
        return {"status": "ok", **asdict(self)}


@dataclass
class DeadLetter:
    """A request that failed for good: a 4xx, a context overflow, an abort, retries exhausted."""

    request_id: str
    error_class: str  # e.g. "http_400", "context_overflow", "abort", "transport_exhausted"
    message: str
    server: str = ""
    attempts: int = 1

    def to_record(self) -> dict[str, Any]:
        return {"status": "dead", **asdict(self)}


Outcome = GenerationResult | DeadLetter
OutcomeSink = Callable[[Outcome], None]


@dataclass
class ServerHealth:
    url: str
    healthy: bool
    in_flight: int = 0
    completed: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    """A generation backend. Thread-safe: several shard tasks may call `generate` at once."""

    name: str

    def generate(self, requests: Iterable[GenerationRequest], sink: OutcomeSink) -> None:
        """Run every request; call `sink` once per request as it finishes (any thread).

        Returns when every request has produced exactly one outcome. Raises only for failures
        of the engine as a whole (no healthy server left), never for a single bad request.
        """
        ...

    def health(self) -> list[ServerHealth]: ...

    def check_servers(self, needs: TargetNeeds) -> list[str]:
        """Before any work: raise WrongModel where a server cannot serve `needs`, and
        ServersUnreachable when none answers; hold every later answer to `needs`. Returns
        notes for the log."""
        ...

    def close(self) -> None: ...


class EngineUnavailable(RuntimeError, ExpectedFailure):
    """No server (or device) can take requests: the shard fails and is retried later."""


class WrongModel(RuntimeError, ExpectedFailure):
    """A server serves another model than the run's target (another vocabulary, or a context
    too short for the run): retrying cannot help, so the run stops, naming the server."""


class ServersUnreachable(RuntimeError, ExpectedFailure):
    """No generation server answered when the stage started: the run stops at once instead of
    waiting out the rotation's timeouts and Prefect's retries."""
