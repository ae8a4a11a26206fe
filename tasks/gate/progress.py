"""Where a running gate is: gate/progress.json in the run folder and one log line per event.

A gate of tens of fresh server launches runs for many minutes (for a large target, an hour);
without this the Prefect UI shows "gate started" and nothing until the decision, and a gate cut
short (a crash, a lease that ends) leaves no word of how far it got. Each event rewrites the
record atomically: the phase (preflight, replay, benchmark, decide, scaling, done), the launches
planned / done / failed, the one in progress, and per finished launch its tok/s, accept length,
start-up seconds (health_s), measuring seconds (warm-up, cost probes and measured requests) and
seconds since its wave started. A launch's server-log tail is kept in the run folder as soon as
the launch ends (gate/server-logs/), not only after the last one. `eaglescale status` reads the
record; nothing reads it to decide anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.gate.records import LaunchRecord, pooled_accept_lengths
from tasks.redaction import redact_text, redact_url
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import GATE_PROGRESS

SERVER_LOGS = "gate/server-logs"
# What is kept of a launch's server log: its start (the arguments, the weights' load, the KV pool,
# the CUDA-graph captures, with their clocks: where a launch's ~60 s before it is ready go) and its
# end (the decode lines, and why it failed). SGLang's server_args line alone is ~9.4 KB.
LOG_HEAD_BYTES = 24 * 1024
LOG_TAIL_BYTES = 48 * 1024

Logger = logging.Logger | logging.LoggerAdapter


def log_head_and_tail(data: bytes, head: int = LOG_HEAD_BYTES, tail: int = LOG_TAIL_BYTES) -> bytes:
    """`data` whole when it fits in head + tail bytes, else its first `head` and last `tail`
    bytes with a line between them saying how many were left out."""
    if len(data) <= head + tail:
        return data
    return data[:head] + f"\n[... {len(data) - head - tail} bytes left out ...]\n".encode() + data[-tail:]


def keep_server_log(run: RunFolder, log_path: str | None) -> None:
    """The start and end of one launch's server log in the run folder (log_head_and_tail): the
    evidence of its start-up, its CUDA-graph captures and decode lines, and why it failed,
    outlive the gate's temporary folder."""
    path = Path(log_path) if log_path else None
    if path is not None and path.is_file():
        run.write_bytes_atomic(f"{SERVER_LOGS}/{path.name}", log_head_and_tail(path.read_bytes()))


def _clean(text: str | None) -> str | None:
    """An error as the record may keep it: no URL credentials, no registered secret."""
    return None if text is None else redact_text(redact_url(text))


def launch_figures(record: LaunchRecord) -> dict[str, Any]:
    """A finished launch's own numbers (the decision pools all launches of a config later)."""
    ok = [r for r in record.requests if r.error is None and r.latency_s > 0]
    tokens, seconds = sum(r.completion_tokens for r in ok), sum(r.latency_s for r in ok)
    overall, per_domain = pooled_accept_lengths(ok)
    return {
        "tok_s": tokens / seconds if seconds > 0 else None,
        "accept_length": overall,  # as the decision pools it: each request's prefill token left out
        "accept_length_per_domain": per_domain,
        "requests": len(record.requests),
        "failed_requests": len(record.requests) - len(ok),
        # Per load level: output tok/s over the level's wall time, and the probed step cost.
        "levels": {k: {"tok_s": v.get("tok_s"), "step_s": record.level_costs.get(k, {}).get("step_s")}
                   for k, v in record.levels.items()},  # fmt: skip
    }


class GateProgress:
    """The record and its log lines. `logger` is where the lines go (the flow's run logger, so
    that they show in the Prefect UI); `clock` is injectable for tests."""

    def __init__(self, run: RunFolder, logger: Logger | None = None, clock: Callable[[], float] = time.time) -> None:
        self.run, self.log, self.clock = run, logger or logging.getLogger(__name__), clock
        now = clock()
        self.data: dict[str, Any] = {
            "state": "running", "phase": None, "started_at": now, "updated_at": now,
            "launches": {"planned": 0, "done": 0, "failed": 0}, "current": None, "finished": [],
        }  # fmt: skip
        self._wave_at: dict[int, float] = {}  # launch -> when its wave started
        self._measuring_at: dict[int, float] = {}

    def _write(self) -> None:
        self.data["updated_at"] = self.clock()
        self.run.write_json_atomic(GATE_PROGRESS, self.data)

    def phase(self, name: str, detail: str = "") -> None:
        self.data.update(phase=name, current=None)
        self.log.info("gate: %s%s", name, f": {detail}" if detail else "")
        self._write()

    def planned(self, launches: int) -> None:
        self.data["launches"]["planned"] = launches
        self._write()

    def wave(self, indices: list[int], names: list[str]) -> None:
        now = self.clock()
        for i in indices:
            self._wave_at[i] = now
        self.data["current"] = f"starting {len(indices)} server(s): {', '.join(names)}"
        self.log.info("gate: %s", self.data["current"])
        self._write()

    def measuring(self, index: int, name: str, rep: int, health_s: float | None) -> None:
        self._measuring_at[index] = self.clock()
        total = self.data["launches"]["planned"]
        self.data["current"] = f"launch {index + 1}/{total} {name} rep {rep}: measuring"
        self.log.info("gate: %s (serving after %.0f s)", self.data["current"], health_s or 0.0)
        self._write()

    def launch_done(self, index: int, record: LaunchRecord) -> None:
        keep_server_log(self.run, record.log_path)
        counts = self.data["launches"]
        counts["done"] += 1
        counts["failed"] += bool(record.error)
        now = self.clock()
        measuring_at = self._measuring_at.get(index)
        row = {"launch": index, "config": record.config, "repetition": record.repetition,
               "health_s": record.health_s, "measure_s": now - measuring_at if measuring_at is not None else None,
               "since_wave_start_s": now - self._wave_at.get(index, now), "error": _clean(record.error),
               **launch_figures(record)}  # fmt: skip
        self.data["finished"].append(row)
        self.data["current"] = None
        figures = (f"{row['tok_s']:.1f} tok/s" if row["tok_s"] else "no tok/s") + (
            f", accept length {row['accept_length']:.2f}" if row["accept_length"] else "")  # fmt: skip
        self.log.info("gate: launch %d/%d %s rep %d done: %s%s", index + 1, counts["planned"], record.config,
                      record.repetition, figures, f" (error: {row['error']})" if record.error else "")  # fmt: skip
        self._write()

    def finished(self, state: str, message: str) -> None:
        self.data.update(state=state, phase="done" if state == "done" else self.data["phase"], message=_clean(message))
        self._write()
