"""tasks/gate/gpu_samples.py: the GPU's clocks beside every launch the gate measures, from
nvidia-smi's own sampling loop. Here a stand-in `nvidia-smi` on PATH prints what the real one
prints (csv, no header, no units) and, as an older driver does, refuses the clock-event field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.load_rehearsal import main
from tasks.gate.gpu_samples import GpuSampler, window_summary

# Every fourth sample at a lower clock; the clock-event reasons field refused, as a driver without
# it refuses the whole query.
FAKE = """#!/bin/bash
case "$*" in *clocks_event_reasons*) echo "Field \\"clocks_event_reasons.active\\" is not a valid field to query."; exit 2;; esac
i=0
while true; do
  if [ $((i % 4)) -eq 3 ]; then c=1410; else c=1980; fi
  echo "$c, 2619, 350.50, 45"
  i=$((i + 1))
  sleep 0.02
done
"""


@pytest.fixture
def nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    fake = tmp_path / "bin/nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(FAKE)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    return fake


def test_the_sampler_reads_the_loop_and_asks_again_without_the_field_a_driver_refuses(nvidia_smi: Path) -> None:
    sampler = GpuSampler(sample_ms=20)
    sampler.start()
    import time

    time.sleep(0.5)
    samples = sampler.stop()
    assert len(samples) >= 5
    assert {s["sm_mhz"] for s in samples} <= {1980.0, 1410.0} and all(s["reasons"] is None for s in samples)
    assert samples[0] == {"t": samples[0]["t"], "sm_mhz": samples[0]["sm_mhz"], "mem_mhz": 2619.0, "power_w": 350.5,
                          "util_pct": 45.0, "reasons": None}  # fmt: skip
    summary = window_summary(samples, samples[0]["t"], samples[-1]["t"])
    assert summary is not None and summary["sm_mhz_median"] == 1980.0 and summary["samples"] == len(samples)
    assert summary["sm_mhz_min"] == (1410.0 if len(samples) >= 4 else 1980.0)
    assert window_summary(samples, 0.0, 1.0) is None  # nothing in that window


def test_a_driver_s_values_read_as_numbers() -> None:
    from tasks.gate.gpu_samples import _number

    assert _number(" 0x0000000000000004") == 4.0  # the clock-event reasons: a bit mask
    assert _number(" 1980") == 1980.0 and _number(" [N/A]") is None and _number("[Not Supported]") is None


def test_without_nvidia_smi_nothing_is_sampled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    sampler = GpuSampler()
    sampler.start()
    assert sampler.stop() == []


def test_every_launch_carries_the_clocks_it_was_measured_at(tmp_path: Path, nvidia_smi: Path) -> None:
    out = tmp_path / "reh"
    assert main([str(out), "--engine", "emulated", "--levels", "1,4", "--prompts", "4", "--new-tokens", "8",
                 "--accept", "eagle3-s3-k1-n4=2.58", "--sweep-only"]) == 0  # fmt: skip
    report = json.loads((out / "run/gate/report.json").read_text())
    for launch in report["bench"]["launches"]:
        assert launch["gpu_samples"] and all(s["sm_mhz"] in (1980.0, 1410.0) for s in launch["gpu_samples"])
        for level in launch["levels"].values():
            assert level["gpu"]["samples"] >= 1 and level["gpu"]["sm_mhz_median"] in (1980.0, 1410.0, 1695.0)
        # Each request's start, to set beside the samples.
        assert all(launch["measured_at"] <= r["started_at"] <= launch["ended_at"] for r in launch["requests"])
    row = next(line for line in (out / "run/gate/report.md").read_text().splitlines() if line.startswith("| baseline | 0 |"))
    assert "| 1980, 1410 |" in row or "| 1980, 1980 |" in row, row
