"""Fault injection for the SGLang-compatible server: what a flaky deployment does to a client.

A `FaultSpec` says which fault, for what fraction of requests (drawn from a seeded RNG, so a
test sees the same sequence every run) and for how many at most. Specs come from the command
line at start-up or from `POST /_fault` at runtime.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

FAULT_MODES = ("none", "5xx", "reset", "timeout", "hang", "slow", "abort")
# "generate": only /generate; "all": also the health, info and cache endpoints (a dead server).
FAULT_SCOPES = ("generate", "all")
HANG_BOUND_S = 600.0


class FaultSpecError(ValueError):
    """A fault spec with a bad field; the message names the field."""


@dataclass(frozen=True)
class FaultSpec:
    mode: str = "none"
    rate: float = 1.0
    count: int | None = None  # at most this many faulty requests; None = no limit
    delay_s: float = 5.0  # slow: added delay; timeout: time before the (late) answer
    status: int | None = None  # 5xx: HTTP status (503); abort: meta status_code (500)
    scope: str = "generate"
    seed: int = 0

    @classmethod
    def from_dict(cls, data: Any) -> FaultSpec:
        if not isinstance(data, dict):
            raise FaultSpecError("fault spec must be a JSON object")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise FaultSpecError(f"fault spec: unknown field(s) {unknown}")
        spec = cls(**data)
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.mode not in FAULT_MODES:
            raise FaultSpecError(f"fault spec: mode {self.mode!r} is not one of {list(FAULT_MODES)}")
        if self.scope not in FAULT_SCOPES:
            raise FaultSpecError(f"fault spec: scope {self.scope!r} is not one of {list(FAULT_SCOPES)}")
        if not _is_number(self.rate) or not 0.0 <= self.rate <= 1.0:
            raise FaultSpecError(f"fault spec: rate must be a number in [0, 1], got {self.rate!r}")
        if self.count is not None and (not _is_int(self.count) or self.count < 0):
            raise FaultSpecError(f"fault spec: count must be an integer >= 0, got {self.count!r}")
        if not _is_number(self.delay_s) or not 0.0 <= self.delay_s <= HANG_BOUND_S:
            raise FaultSpecError(
                f"fault spec: delay_s must be a number in [0, {HANG_BOUND_S:g}], got {self.delay_s!r}"
            )
        if not _is_int(self.seed):
            raise FaultSpecError(f"fault spec: seed must be an integer, got {self.seed!r}")
        if self.status is not None:
            if not _is_int(self.status):
                raise FaultSpecError(f"fault spec: status must be an integer, got {self.status!r}")
            if self.mode == "5xx" and not 500 <= self.status <= 599:
                raise FaultSpecError(f"fault spec: status for mode 5xx must be 500..599, got {self.status}")
            if self.mode == "abort" and not 400 <= self.status <= 599:
                raise FaultSpecError(f"fault spec: status for mode abort must be 400..599, got {self.status}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class FaultInjector:
    """Decides, request by request, whether to inject the configured fault."""

    def __init__(self, spec: FaultSpec | None = None) -> None:
        self.injected = 0
        self.by_mode: dict[str, int] = {}
        self.configure(spec or FaultSpec())

    def configure(self, spec: FaultSpec) -> None:
        spec.validate()
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self._remaining = spec.count

    def draw(self, endpoint: str) -> str | None:
        """The fault to inject into this request to `endpoint` ("generate" or another), or None."""
        spec = self.spec
        if spec.mode == "none" or (spec.scope == "generate" and endpoint != "generate"):
            return None
        if self._remaining is not None and self._remaining <= 0:
            return None
        if spec.rate < 1.0 and self._rng.random() >= spec.rate:
            return None
        if self._remaining is not None:
            self._remaining -= 1
        self.injected += 1
        self.by_mode[spec.mode] = self.by_mode.get(spec.mode, 0) + 1
        return spec.mode

    def stats(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "injected": self.injected,
            "by_mode": dict(self.by_mode),
            "remaining": self._remaining,
        }
