"""The one formatter for what people read (tasks/humanize.py), the stages' stories for Slack
(tasks/story.py) and the figures a watcher reads (tasks/status/figures.py), on the values the
stages really produce."""

from __future__ import annotations

import tasks.humanize as h
from tasks import story
from tasks.status.figures import decision_line, progress_figures, progress_markdown
from tests.slack_support import FLOAT, REPR

NOW = 1_700_000_000.0


def test_numbers_have_three_or_four_significant_digits_and_units() -> None:
    assert [h.number(x) for x in (0.8389377069980071, 1.3755248221309815, 123.456, 12345.678, 0.0016553616785258442)] == [
        "0.8389", "1.376", "123.5", "12,346", "0.001655"]  # fmt: skip
    assert (h.number(2889476), h.number(1e-7), h.number(None), h.number(True)) == ("2,889,476", "1e-7", "—", "yes")
    assert h.ci(0.6851852549722078, 1.3755248221309815) == "[0.685, 1.38]"
    assert h.ci(1.23, 1.4) == "[1.23, 1.40]"  # trailing zeros kept: the two ends line up
    assert h.speedup(0.8389377069980071, 0.685, 1.3755) == "0.839x [0.685, 1.38]"
    assert (h.size(2889476), h.size(74406338560), h.size(517)) == ("2.89 MB", "74.4 GB", "517 B")
    assert (h.percent(0.8667), h.percent(0.0), h.percent(1.0)) == ("86.7%", "0%", "100%")
    assert (h.duration(3725), h.duration(4.2), h.duration(0.042, precise=True)) == ("1h 02m 05s", "4s", "42 ms")


def test_values_by_their_key_and_never_a_repr() -> None:
    assert h.value({}, "dead_classes") == "none" and h.value([], "scaling_drafts") == "none"
    assert h.value(None) == "—" and h.value(False) == "no"
    assert h.value({"aux": 0.0016553616785258442, "last": 0.0016649061796231725}) == "aux 0.001655, last 0.001665"
    assert h.value([None, None], "ci") == "—"
    assert (h.value(0.8667, "finish_length_rate"), h.value(12.5, "rate"), h.value(0.01, "learning_rate")) == (
        "86.7%", "12.5", "0.01")  # fmt: skip
    assert (h.value(2.5, "tokens_per_s"), h.value(0.318, "train_step_s"), h.value(900, "eta_s")) == ("2.5", "318 ms", "15m 00s")
    assert h.fields({"reused_from": None, "total_bytes": 5_000_000, "skipped": False}, drop=("skipped",)) == {
        "total bytes": "5 MB"}  # fmt: skip


def test_wide_tables_are_split_to_fit_and_narrow_ones_kept() -> None:
    wide = "intro\n| a | b | c | d | e | f | g | h |\n|---|---|---|---|---|---|---|---|\n| 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |\nend"
    assert h.fit_tables(wide) == (
        "intro\n| a | b | c | d | e | f |\n|---|---|---|---|---|---|\n| 1 | 2 | 3 | 4 | 5 | 6 |\n\n"
        "| a | g | h |\n|---|---|---|\n| 1 | 7 | 8 |\nend"
    )
    narrow = "| a | b |\n|---|---|\n| x \\| y | 2 |\n"
    assert h.fit_tables(narrow) == narrow


GENERATE_SUMMARY = {  # a generate stage's summary, as the flow returns it
    "shards_total": 3, "shards_committed": 3, "rows": 58, "dead": 2, "prompt_tokens": 4628,
    "completion_tokens": 900, "finish_length_rate": 0.8666666666666667, "empty_outputs": 0,
    "unterminated_think": 0, "dead_classes": {"context_overflow": 2}, "requests_sent": 61,
    "sent_per_request": 1.0167, "reused": 0, "reused_from": None,
}  # fmt: skip


def test_each_stage_tells_its_figures_in_a_line() -> None:
    headline, fields = story.completed("generate", GENERATE_SUMMARY)
    assert headline == "58 rows in 3 / 3 shards, 900 tokens, 2 dead letters"
    assert fields["dead letters"] == "2 (context_overflow 2)" and fields["hit max_new_tokens"] == "86.7%"
    assert "reused" not in fields and "empty outputs" not in fields  # nothing to flag: not shown
    headline, _ = story.completed("discover", {"skipped": False, "rows_read": 317, "kept": 60, "holdout": 24,
                                               "malformed": 10, "over_quota": 216, "too_long": 0})  # fmt: skip
    assert headline == "60 prompts kept of 317 read, 24 held out"
    assert story.completed("discover", {"rows_read": 1, "kept": 1, "holdout": 0, "malformed": 1})[1]["left out"] == "malformed 1"
    # A summary of another shape is shown whole, each field readable.
    assert story.completed("train", {"stopped_for_budget": "train", "steps": 40}) == (
        "", {"stopped for budget": "train", "steps": "40"})  # fmt: skip
    headline, fields = story.started("extract", {"shards_to_run": 3, "total_bytes": 2889476, "fits": True,
                                                 "summary": "2.9 MB (5,588 tokens × 517 B/token, bf16)"})  # fmt: skip
    assert headline == "3 shards to run; forecast 2.9 MB (5,588 tokens × 517 B/token, bf16)"
    assert fields == {"shards to run": "3", "fits": "yes", "forecast": "2.9 MB (5,588 tokens × 517 B/token, bf16)"}
    for text in [headline, *fields.values(), *story.completed("generate", GENERATE_SUMMARY)[1].values()]:
        assert not REPR.search(text) and all(len(f.replace(".", "").lstrip("0")) <= 6 for f in FLOAT.findall(text))


def test_live_progress_figures_say_where_generation_is() -> None:
    progress = {  # generate/progress.json mid-run
        "state": "running", "heartbeat_at": NOW - 2, "last_progress_at": NOW - 5, "percent": 43.47826086956522,
        "requests": {"done": 120, "total": 276, "dead": 3},
        "tokens": {"prompt_done": 9000, "completion_done": 3840, "completion_total_estimate": 8832.7},
        "rate": {"window_tokens_per_s": 310.47, "requests_per_s": 2.0833333, "window_s": 300.0},
        "eta_s": 3723.4, "eta_at": NOW + 3723.4,
        "shard_counts": {"committed": 2, "running": 2, "pending": 3},
        "dead_classes": {"context_overflow": 2, "in running shards": 1},
        "servers": [{"url": "http://a:30000", "healthy": True}, {"url": "http://b:30000", "healthy": False, "last_error": "ConnectError"}],
    }  # fmt: skip
    rows = dict(progress_figures(progress, NOW))
    assert rows == {
        "requests": "120 / 276 (43.5%)",
        "tokens": "3,840 generated of ~8,833; 9,000 prompt tokens",
        "rate": "310.5 tok/s, 2.08 req/s (last 5m 00s)",
        "ETA": "1h 02m 03s, at 2023-11-14 23:15:23 UTC",
        "dead letters": "3: context_overflow 2, in running shards 1",
        "shards": "2 committed · 2 running · 3 pending (of 7)",
        "servers": "1 / 2 up; down: http://b:30000 (ConnectError)",
        "heartbeat": "2s ago",
        "last result": "5s ago",
    }
    # status passes the shard states markers and leases say (a live lease elsewhere).
    assert dict(progress_figures(progress, NOW, {"committed": 2, "leased": 1}))["shards"] == "2 committed · 1 leased (of 3)"
    # A process younger than its rate window measured the rate over its age, and says so.
    young = {**progress, "started_at": NOW - 6.2, "updated_at": NOW}
    assert dict(progress_figures(young, NOW))["rate"] == "310.5 tok/s, 2.08 req/s (last 6s)"
    md = progress_markdown(progress, NOW, "Generation, live", "/runs/r")
    assert "| requests | 120 / 276 (43.5%) |" in md and md.startswith("# Generation, live\n\n**RUNNING**")
    assert decision_line({"outcome": "reject", "speedup": 0.8389377069980071, "ci": [0.6851852549722078, 1.3755],
                          "accept_length": 1.15}) == "REJECT: speedup 0.839x [0.685, 1.38], accept length 1.15"  # fmt: skip
    assert decision_line({"outcome": "stopped", "speedup": None, "ci": [None, None]}) == "STOPPED"
