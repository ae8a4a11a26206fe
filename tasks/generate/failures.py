"""Why generation shards failed, and the fix that applies to each cause.

A shard whose dead letters exceed `generate.max_dead_fraction` fails with ShardFailed, which keeps
the count per error class; the stage folds the failures of all its shards into one
GenerateFailed, whose message gives those counts summed and, per class, the fix that can help:
`generate.retry_dead` resends dead letters, which cures a transport failure once the servers are
healthy but sends a context overflow straight back into the same limit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from tasks.engines.base import ServersUnreachable, WrongModel
from tasks.errors import ExpectedFailure
from tasks.runfolder import RunRootUnwritable, unwritable, unwritable_error

RETRY_DEAD = "--set generate.retry_dead=true"
EXAMPLE_CHARS = 200


def _now(settings: Mapping[str, Any], key: str) -> str:
    return f" (now {settings[key]})" if settings.get(key) is not None else ""


def fix_for(error_class: str, settings: Mapping[str, Any] | None = None) -> str:
    """What helps requests that died with `error_class`. `settings` may hold the current
    values of the keys named (dotted config keys), to quote them."""
    s = settings or {}
    if error_class == "context_overflow":
        return (
            f"the prompt plus sampling.max_new_tokens{_now(s, 'sampling.max_new_tokens')} does not "
            "fit the server's context length; retrying alone sends them into the same limit. "
            "Either raise the server's context length (SGLang --context-length; engine.kind=local: "
            f"the target's) and rerun with {RETRY_DEAD}, or lower discover.max_prompt_tokens"
            f"{_now(s, 'discover.max_prompt_tokens')} (or a domain's own, discover.max_prompt_tokens_by_domain) "
            "or sampling.max_new_tokens on a new run root "
            "(both change the run's fingerprint), or accept the loss with a higher "
            f"generate.max_dead_fraction{_now(s, 'generate.max_dead_fraction')}"
        )
    if error_class == "transport_exhausted":
        return (
            "every attempt failed in transport (connection errors, timeouts, 5xx): once the "
            "servers answer again (`eaglescale status RUN_ROOT` shows their health and last "
            f"errors), rerun with {RETRY_DEAD}"
        )
    if error_class == "invalid_input" or error_class.startswith(("http_4", "abort_4")):
        return (
            "the server refused the request itself (the example says why: a sampling setting it "
            "rejects, or a server that does not speak SGLang's /generate); fix that setting or "
            f"server, then rerun with {RETRY_DEAD}"
        )
    return f"see the example message; once its cause is fixed, rerun with {RETRY_DEAD}"


def cannot_heal(exc: BaseException) -> bool:
    """Failures no retry heals: a server of another model, no server answering at the start,
    a run root that refuses writes. They fail the run once, at once: no Prefect task retry,
    and the other shards are not started."""
    return isinstance(exc, WrongModel | ServersUnreachable) or unwritable(exc)


def lasting_failure(causes: Mapping[str, BaseException | str], run_url: str) -> BaseException | None:
    """The first failure among `causes` that no retry heals, as the run's one error (a refused
    write as RunRootUnwritable, naming the run root); None when every cause may heal."""
    for _, cause in sorted(causes.items()):
        if isinstance(cause, BaseException) and cannot_heal(cause):
            if isinstance(cause, OSError) and not isinstance(cause, RunRootUnwritable):
                return unwritable_error(run_url, cause)
            return cause
    return None


class ShardStopped(RuntimeError):
    """A shard ended because the run is stopping (a signal): its results so far are journaled,
    and it is not retried."""


class ShardFailed(RuntimeError, ExpectedFailure):
    """A shard whose dead letters exceed the configured fraction: loud, not committed. Keeps
    the dead letters' count per error class and one example message of each."""

    def __init__(
        self,
        message: str,
        shard_id: str = "",
        planned: int = 0,
        dead_classes: Mapping[str, int] | None = None,
        examples: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.shard_id = shard_id
        self.planned = planned
        self.dead_classes = dict(dead_classes or {})
        self.examples = dict(examples or {})

    def __reduce__(self) -> tuple[Any, ...]:
        # Prefect may persist task exceptions: keep the counts through a pickle round trip.
        return (type(self), (str(self), self.shard_id, self.planned, self.dead_classes, self.examples))


def dead_fraction_failure(
    shard_id: str, planned: int, dead: pa.Table, max_dead_fraction: float
) -> ShardFailed:
    classes = Counter(dead.column("error_class").to_pylist())
    examples: dict[str, str] = {}
    for error_class, message in zip(
        dead.column("error_class").to_pylist(), dead.column("message").to_pylist(), strict=True
    ):
        examples.setdefault(error_class, (message or "")[:EXAMPLE_CHARS])
    lines = [
        f"shard {shard_id}: {dead.num_rows} of {planned} requests dead "
        f"({dead.num_rows / planned:.1%} > generate.max_dead_fraction {max_dead_fraction:.1%}); "
        "results so far are journaled."
    ]
    lines += [f"  {c} x{n}: {fix_for(c)}" for c, n in classes.most_common()]
    return ShardFailed("\n".join(lines), shard_id, planned, classes, examples)


class GenerateFailed(RuntimeError):
    """Shards of the generate stage were not committed; `causes` maps each to its error."""

    def __init__(self, message: str, causes: Mapping[str, BaseException | str] | None = None) -> None:
        super().__init__(message)
        self.causes = dict(causes or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.causes))


def generate_failed(
    causes: Mapping[str, BaseException | str],
    shards_total: int,
    max_dead_fraction: float,
    settings: Mapping[str, Any] | None = None,
) -> GenerateFailed:
    """One message for every shard that failed: dead letters per class summed over the shards
    over the bound, each with its fix, then the other errors, grouped by message."""
    dead: Counter[str] = Counter()
    examples: dict[str, str] = {}
    over, planned = 0, 0
    others: dict[str, list[str]] = {}
    for shard_id, cause in sorted(causes.items()):
        if isinstance(cause, ShardFailed) and cause.dead_classes:
            over += 1
            planned += cause.planned
            dead.update(cause.dead_classes)
            for c, example in cause.examples.items():
                examples.setdefault(c, example)
            continue
        text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        others.setdefault(text, []).append(shard_id)
    lines = [
        f"generate: {len(causes)} of {shards_total} shards not committed. Results so far are "
        "journaled: a rerun on this run root sends only what is missing."
    ]
    if over:
        lines.append(
            f"{over} shard(s) over generate.max_dead_fraction ({max_dead_fraction:.1%}): "
            f"{sum(dead.values())} dead letters of {planned} requests:"
        )
        for error_class, n in dead.most_common():
            lines.append(f"  {error_class}: {n} request(s). Fix: {fix_for(error_class, settings)}.")
            if examples.get(error_class):
                lines.append(f"    e.g. {examples[error_class]!r}")
    for text, shards in others.items():
        which = shards[0] if len(shards) == 1 else f"{len(shards)} shards ({shards[0]}, ...)"
        lines.append(f"{which}: {text}")
        if text.startswith("EngineUnavailable"):
            lines.append(
                "  Fix: start the servers or correct engine.endpoints (each must answer "
                "/health_generate), then rerun."
            )
    return GenerateFailed("\n".join(lines), causes)
