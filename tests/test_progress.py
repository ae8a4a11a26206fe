"""ProgressTracker and its arithmetic on constructed timelines (an injected clock)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tasks.engines.base import ServerHealth
from tasks.generate.progress import (
    ProgressTracker,
    RateWindow,
    ShardDone,
    eta_seconds,
    lifetime_rate,
    mean_completion_tokens,
    remaining_tokens,
    stalled_for,
    window_rate,
)
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import GENERATE_PROGRESS


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_pure_rates_and_eta() -> None:
    assert lifetime_rate(600, started_at=100, now=400) == 2.0
    assert lifetime_rate(5, started_at=100, now=100) is None
    # younger than the window: divide by age; older: by the window
    assert window_rate(120, started_at=0, now=60, window_s=300) == 2.0
    assert window_rate(900, started_at=0, now=1000, window_s=300) == 3.0
    assert mean_completion_tokens(0, 0, default=256) == 256.0
    assert mean_completion_tokens(1000, 8, default=256) == 125.0
    assert remaining_tokens(100, 40, 125.0) == 7500.0
    assert remaining_tokens(100, 120, 125.0) == 0
    assert eta_seconds(7500.0, 25.0) == 300.0
    assert eta_seconds(7500.0, None) is None
    assert eta_seconds(7500.0, 0.0) is None
    assert eta_seconds(0.0, None) == 0.0
    assert stalled_for(100, now=1000, stall_after_s=900) is None
    assert stalled_for(99, now=1000, stall_after_s=900) == 901


def test_rate_window_keeps_only_trailing_seconds() -> None:
    w = RateWindow(window_s=10)
    for t in range(0, 30):
        w.add(t + 0.25, tokens=10, requests=1)
        w.add(t + 0.75, tokens=10, requests=1)
    assert w.totals(now=29.9) == (200.0, 20.0)  # seconds 20..29
    assert len(w._buckets) == 10
    # a bucket is kept while its start second is inside (now - window_s, now]
    assert w.totals(now=35.0) == (80.0, 8.0)  # seconds 26..29
    assert w.totals(now=100.0) == (0.0, 0.0)


def _tracker(tmp_path: Path, clock: Clock, reused_from: str | None = None, **kw: float) -> ProgressTracker:
    shards = {"s0": {"requests": 10}, "s1": {"requests": 10}, "s2": {"requests": 20}}
    return ProgressTracker(
        RunFolder(str(tmp_path / "run")),
        shards,
        max_new_tokens=100,
        stall_after_s=kw.get("stall_after_s", 900.0),
        interval_s=30.0,
        clock=clock,
        window_s=kw.get("window_s", 300.0),
        reused_from=reused_from,
    )


def test_fresh_run_eta_uses_max_new_tokens_before_any_finish(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock)
    snap = tracker.snapshot()
    assert snap["requests"] == {
        "done": 0, "total": 40, "dead": 0, "done_this_run": 0,
        "sent": 0, "sent_per_request": None, "sent_this_run": 0,
    }  # fmt: skip
    assert snap["tokens"]["completion_total_estimate"] == 4000
    assert snap["eta_s"] is None and snap["eta_at"] is None
    assert snap["rate"]["lifetime_tokens_per_s"] is None
    assert snap["percent"] == 0.0
    assert snap["shard_counts"] == {"pending": 3}


def test_restart_committed_shards_count_as_done_not_in_rate(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock)
    # found at start: s0 committed earlier (10 requests, 1 dead, 900 completion tokens)
    tracker.mark_committed("s0", ShardDone(requests=10, prompt_tokens=500, completion_tokens=900, dead=1))
    tracker.shard_state("s1", "running", attempt="a1")
    clock.t = 1010.0
    tracker.record("s1", requests=2, prompt_tokens=100, completion_tokens=200, sent=3)  # a retry
    clock.t = 1100.0
    tracker.record("s1", requests=3, prompt_tokens=150, completion_tokens=300)
    snap = tracker.snapshot()

    # s0's marker predates send counts: one send per request; s1 sent 3 + 3 for its 5
    assert snap["requests"] == {
        "done": 15, "total": 40, "dead": 1, "done_this_run": 5,
        "sent": 16, "sent_per_request": 16 / 15, "sent_this_run": 6,
    }  # fmt: skip
    assert snap["tokens"]["prompt_done"] == 750
    assert snap["tokens"]["completion_done"] == 1400
    assert snap["tokens"]["completion_this_run"] == 500
    # rate counts only the 500 tokens generated here, over 100 s
    assert snap["rate"]["lifetime_tokens_per_s"] == 5.0
    assert snap["rate"]["window_tokens_per_s"] == 5.0
    assert snap["rate"]["requests_per_s"] == 0.05
    # mean over finished non-dead requests: 1400 / 14 = 100; 25 left -> 2500 tokens at 5 tok/s
    assert snap["tokens"]["mean_completion_per_request"] == 100.0
    assert snap["tokens"]["completion_total_estimate"] == 3900
    assert snap["eta_s"] == 500.0
    assert snap["eta_at"] == 1600.0
    assert snap["percent"] == 37.5
    assert snap["shards"]["s0"] == {
        "state": "committed",
        "requests": 10,
        "done": 10,
        "dead": 1,
        "completion_tokens": 900,
    }
    assert snap["shards"]["s1"] == {
        "state": "running",
        "requests": 10,
        "done": 5,
        "dead": 0,
        "completion_tokens": 500,
        "attempt": "a1",
    }
    assert snap["shard_counts"] == {"committed": 1, "running": 1, "pending": 1}


def test_window_rate_diverges_from_lifetime_after_a_slowdown(tmp_path: Path) -> None:
    clock = Clock(0.0)
    tracker = _tracker(tmp_path, clock, window_s=100.0)
    for t in range(0, 100):  # fast phase: 10 tokens/s
        clock.t = float(t)
        tracker.record("s2", requests=1, prompt_tokens=1, completion_tokens=10)
    for t in range(100, 400, 10):  # slow phase: 1 token/s
        clock.t = float(t)
        tracker.record("s2", requests=0, prompt_tokens=0, completion_tokens=10)
    clock.t = 400.0
    rate = tracker.snapshot()["rate"]
    assert rate["lifetime_tokens_per_s"] == (1000 + 300) / 400
    # window (300, 400]: records at 310..390 -> 9 x 10 tokens over 100 s
    assert rate["window_tokens_per_s"] == 0.9
    assert rate["window_s"] == 100.0


def test_reused_requests_are_done_but_never_sent_nor_in_the_rate(tmp_path: Path) -> None:
    """generate.reuse_from: requests copied from an earlier run count as done and as reused,
    not as sent, and requests sent per request is over the others (1.0: none sent twice)."""
    clock = Clock(0.0)
    tracker = _tracker(tmp_path, clock, reused_from="s3://runs/first-user")
    tracker.mark_committed("s0", ShardDone(requests=10, prompt_tokens=100, completion_tokens=500, sent=4, reused=6))
    clock.t = 10.0
    # s1's journal holds 5 reused outcomes (no send) and 1 generated after 2 sends
    tracker.mark_resumed("s1", ShardDone(requests=6, prompt_tokens=60, completion_tokens=300, sent=2, reused=5))
    tracker.record("s1", requests=2, prompt_tokens=20, completion_tokens=100)
    snap = tracker.snapshot()
    assert snap["reused"] == {"requests": 11, "from": "s3://runs/first-user"}
    assert snap["requests"]["done"] == 18 and snap["requests"]["done_this_run"] == 2
    assert (snap["requests"]["sent"], snap["requests"]["sent_per_request"]) == (8, 8 / 7)
    assert snap["rate"]["lifetime_tokens_per_s"] == 10.0  # the 100 tokens generated here only
    assert _tracker(tmp_path, clock).snapshot()["reused"] == {"requests": 0, "from": None}


def test_mark_resumed_replaces_shard_counts(tmp_path: Path) -> None:
    clock = Clock(0.0)
    tracker = _tracker(tmp_path, clock)
    clock.t = 10.0
    tracker.record("s2", requests=4, prompt_tokens=40, completion_tokens=400)
    # the attempt fails; its retry replays the journal, which holds those 4 plus 2 earlier ones
    tracker.mark_resumed("s2", ShardDone(requests=6, prompt_tokens=60, completion_tokens=600, sent=9))
    snap = tracker.snapshot()
    assert snap["shards"]["s2"]["done"] == 6
    assert (snap["requests"]["sent"], snap["requests"]["sent_per_request"]) == (9, 1.5)
    assert snap["requests"]["done"] == 6
    assert snap["requests"]["done_this_run"] == 4
    assert snap["rate"]["lifetime_tokens_per_s"] == 40.0
    # what the caller states at commit (the marker's counts) is shown over the tracker's own
    tracker.record("s2", requests=14, prompt_tokens=0, completion_tokens=0)
    tracker.shard_state("s2", "committed", rows=19, dead=1)
    shard = tracker.snapshot()["shards"]["s2"]
    assert (shard["state"], shard["done"], shard["rows"], shard["dead"]) == ("committed", 20, 19, 1)


def test_write_heartbeat_interval_and_file(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock)
    tracker.set_server_health([ServerHealth(url="http://a:30000", healthy=True, completed=3)])
    assert tracker.maybe_write() is True
    clock.t = 1029.0
    assert tracker.maybe_write() is False
    clock.t = 1030.0
    assert tracker.maybe_write() is True
    tracker.set_state("complete")
    tracker.write()
    body = json.loads((tmp_path / "run" / GENERATE_PROGRESS).read_text())
    assert set(body) == {
        "updated_at",
        "heartbeat_at",
        "last_progress_at",
        "started_at",
        "first_started_at",
        "stall_after_s",
        "state",
        "requests",
        "reused",
        "tokens",
        "rate",
        "eta_s",
        "eta_at",
        "percent",
        "shard_counts",
        "dead_classes",
        "shards",
        "servers",
    }
    assert body["heartbeat_at"] == 1030.0
    assert body["last_progress_at"] is None
    assert body["state"] == "complete"
    assert body["servers"] == [
        {
            "url": "http://a:30000",
            "healthy": True,
            "in_flight": 0,
            "completed": 3,
            "failures": 0,
            "consecutive_failures": 0,
            "last_error": "",
            "extra": {},
        }
    ]
    with pytest.raises(ValueError, match="run state must be one of"):
        tracker.set_state("done")


def test_in_process_stall_and_bad_shard_ids(tmp_path: Path) -> None:
    clock = Clock(0.0)
    tracker = _tracker(tmp_path, clock, stall_after_s=60.0)
    clock.t = 60.0
    assert tracker.stalled_for() is None
    clock.t = 61.0
    assert tracker.stalled_for() == 61.0
    tracker.record("s0", 1, 1, 1)
    clock.t = 100.0
    assert tracker.stalled_for() is None
    with pytest.raises(ValueError, match="shard 'nope' is not in the plan"):
        tracker.record("nope", 1, 1, 1)
    with pytest.raises(ValueError, match="shard 'x': plan entry has no 'requests' count"):
        ProgressTracker(RunFolder(str(tmp_path / "r2")), {"x": {}}, 10, 60.0)


def test_concurrent_records_are_all_counted(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path, Clock(5.0))

    def work(shard: str) -> None:
        for _ in range(2000):
            tracker.record(shard, requests=1, prompt_tokens=2, completion_tokens=3)

    threads = [threading.Thread(target=work, args=(s,)) for s in ("s0", "s1", "s2", "s2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = tracker.snapshot()
    assert snap["requests"]["done"] == 8000
    assert snap["tokens"]["completion_done"] == 24000
    assert snap["shards"]["s2"]["done"] == 4000


def test_failed_write_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tracker = _tracker(tmp_path, Clock(0.0))
    # a file where the generate/ folder should be makes the write fail
    (tmp_path / "run" / "generate").write_text("not a folder")
    assert tracker.maybe_write() is False
    assert "could not write generate/progress.json" in caplog.text


def test_first_start_survives_a_resume(tmp_path: Path) -> None:
    from tasks.generate.progress import first_started_at

    clock = Clock(1000.0)
    tracker = _tracker(tmp_path, clock)
    tracker.record("s0", requests=1, prompt_tokens=1, completion_tokens=5)
    tracker.write()
    written = json.loads((tmp_path / "run" / GENERATE_PROGRESS).read_text())
    assert written["first_started_at"] == written["started_at"] == 1000.0
    # a later process (a resume, or a rerun with nothing left) starts from what it finds
    clock.t = 5000.0
    later = ProgressTracker(
        RunFolder(str(tmp_path / "run")), {"s0": {"requests": 10}}, max_new_tokens=100,
        stall_after_s=900.0, clock=clock, first_started_at=first_started_at(written),
    )  # fmt: skip
    snap = later.snapshot()
    assert (snap["first_started_at"], snap["started_at"]) == (1000.0, 5000.0)
    # files from before the first start was kept: their start counts only if they generated
    old = {"started_at": 900.0, "requests": {"done_this_run": 3}}
    assert first_started_at(old) == 900.0
    assert first_started_at({**old, "requests": {"done_this_run": 0}}) is None
    assert first_started_at(None) is None


def test_dead_letters_by_class_from_the_markers(tmp_path: Path) -> None:
    """By class over the committed shards (their markers count them), this process's own commits
    included (seen when it reads the markers again); those of a running shard as such."""
    tracker = _tracker(tmp_path, Clock())
    marker = {"rows": 8, "dead": 2, "dead_classes": {"context_overflow": 1, "http_400": 1}}
    tracker.mark_committed("s0", ShardDone.from_marker(marker))
    tracker.shard_state("s1", "running")
    tracker.record("s1", requests=2, prompt_tokens=10, completion_tokens=0, dead=2)
    assert tracker.snapshot()["dead_classes"] == {"context_overflow": 1, "http_400": 1, "in running shards": 2}
    tracker.shard_state("s1", "committed", rows=8, dead=2)  # committed here: its class comes with its marker
    committed = {"rows": 8, "dead": 2, "dead_classes": {"context_overflow": 2}}
    assert tracker.note_committed_elsewhere("s1", ShardDone.from_marker(committed)) is False
    assert tracker.snapshot()["dead_classes"] == {"context_overflow": 3, "http_400": 1}
