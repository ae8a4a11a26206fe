"""What the GPU was doing while a launch was measured: its SM and memory clocks, power, utilisation
and the driver's active clock-event reasons, sampled by nvidia-smi's own loop every SAMPLE_MS
(`nvidia-smi --query-gpu=... -lms`), each line stamped with the wall clock as it is read.

A speculative launch has run a stretch of its requests ~40% slower per token than its twin launch,
then as fast again, its server log silent on why (BENCHMARKS P34, P35); the samples, set beside each
request's start (RequestRecord.started_at) and each level's window, say whether the GPU's clocks
moved with it. Where nvidia-smi is absent (this CPU box, the emulator) nothing is sampled."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

SAMPLE_MS = 250
# What each line holds, in order; the last (the active clock-event reasons, a bit mask) is left out
# where the driver does not know the field (nvidia-smi refuses the whole query then).
FIELDS = ("sm_mhz", "mem_mhz", "power_w", "util_pct", "reasons")
QUERY = ("clocks.sm", "clocks.mem", "power.draw", "utilization.gpu", "clocks_event_reasons.active")


def _number(text: str) -> float | None:
    text = text.strip()
    if text.startswith("0x"):
        return float(int(text, 16))
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


class GpuSampler:
    """nvidia-smi's sampling loop for one launch: start() it, stop() it for its samples, each
    {"t": wall clock, "sm_mhz", "mem_mhz", "power_w", "util_pct", "reasons"}."""

    def __init__(self, sample_ms: int = SAMPLE_MS) -> None:
        self.sample_ms = sample_ms
        self.samples: list[dict[str, float | None]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = False

    def _spawn(self, fields: tuple[str, ...]) -> subprocess.Popen[str]:
        device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        return subprocess.Popen(["nvidia-smi", "-i", device, f"--query-gpu={','.join(fields)}",
                                 "--format=csv,noheader,nounits", f"-lms={self.sample_ms}"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip

    def start(self) -> None:
        if shutil.which("nvidia-smi") is not None:
            self._reader = threading.Thread(target=self._run, daemon=True)
            self._reader.start()

    def _run(self) -> None:
        """The loop's lines as samples; a query the driver refuses (it exits at once, saying
        nothing on stdout) is asked again without the clock-event reasons."""
        for fields in (QUERY, QUERY[:-1]):
            with self._lock:
                if self._stopping:
                    return
                self._proc = self._spawn(fields)
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                values = [_number(v) for v in line.split(",")]
                if len(values) >= len(FIELDS) - 1:  # every field, or all but the reasons
                    padded = [*values, None][: len(FIELDS)]
                    self.samples.append({"t": time.time(), **dict(zip(FIELDS, padded, strict=True))})
            self._proc.wait()
            if self.samples:
                return

    def stop(self) -> list[dict[str, float | None]]:
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)
        return self.samples


def window_summary(samples: list[dict[str, Any]], began: float, ended: float) -> dict[str, float | None] | None:
    """The samples taken between `began` and `ended` (a level's window): the median and lowest SM
    clock, the median power and utilisation; None when none fell in it."""
    inside = [s for s in samples if began <= s["t"] <= ended and s.get("sm_mhz") is not None]
    if not inside:
        return None
    sm = [s["sm_mhz"] for s in inside]
    power = [s["power_w"] for s in inside if s.get("power_w") is not None]
    util = [s["util_pct"] for s in inside if s.get("util_pct") is not None]
    return {"samples": len(inside), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
            "power_w_median": statistics.median(power) if power else None,
            "util_pct_median": statistics.median(util) if util else None}  # fmt: skip
