"""The goal arithmetic of benchmarks/p7_overlap.py on hand-made stage clocks.

The benchmark itself takes ~12 minutes; what it concludes rests on `summarize`, so the bound
(the sequential run's longer of generate/extract + the overlapped run's discover and train), the
spans and the verdicts are checked here on clocks whose answers are known.
"""

from __future__ import annotations

import pytest

from benchmarks.p7_overlap import sizes, summarize

SEQUENTIAL = {  # one after another: discover 10 s, generate 100 s, extract 80 s, train 20 s
    "discover": (1000.0, 1010.0),
    "generate": (1011.0, 1111.0),
    "extract": (1112.0, 1192.0),
    "train": (1193.0, 1213.0),
}


def _overlapped(extract_end: float, train_s: float = 22.0) -> dict[str, tuple[float, float]]:
    return {
        "discover": (5000.0, 5012.0),  # 12 s: the overlapped run's own, not the sequential 10
        "generate": (5013.0, 5118.0),
        "extract": (5014.0, extract_end),
        "train": (extract_end + 1.0, extract_end + 1.0 + train_s),
    }


def test_summary_of_an_overlap_that_meets_the_goal() -> None:
    s = summarize({"sequential": SEQUENTIAL, "overlapped": _overlapped(5120.0)})
    assert s["sum_of_stages"]["sequential"] == pytest.approx(210.0)
    assert s["span"]["sequential"] == pytest.approx(213.0)
    assert s["span"]["overlapped"] == pytest.approx(143.0)  # 5000 -> 5143
    assert s["generate_extract_window"] == pytest.approx({"sequential": 181.0, "overlapped": 107.0})
    assert s["longest_of_generate_extract"] == pytest.approx(100.0)  # the sequential generate
    # what cannot overlap: the overlapped run's own discover and train
    assert s["cannot_overlap"] == pytest.approx(12.0 + 22.0)
    assert s["goal"] == pytest.approx(1.15 * 134.0)
    assert s["met"] and s["window_met"]
    assert s["overlapped_over_sequential"] == pytest.approx(143.0 / 213.0)


def test_summary_of_an_overlap_that_misses_the_goal() -> None:
    # Extraction ends 60 s after generation: the window (5013 -> 5178 = 165 s) is past
    # 1.15 x 100 s, and the whole span (5000 -> 5201 = 201 s) past 1.15 x 134 s = 154.1 s.
    s = summarize({"sequential": SEQUENTIAL, "overlapped": _overlapped(5178.0)})
    assert s["generate_extract_window"]["overlapped"] == pytest.approx(165.0)
    assert not s["window_met"]
    assert s["span"]["overlapped"] == pytest.approx(201.0)
    assert not s["met"]
    assert s["overlapped_over_bound"] == pytest.approx(201.0 / 134.0)


def test_sizes_keep_a_shard_the_share_of_the_pool_it_has_in_production() -> None:
    assert sizes(83_288, 167) == (499, 128)  # kimi-k25 itself (its 500 gives 167 shards too)
    assert sizes(6_000, 167) == (36, 9)  # 8 x 36 = 288 in flight against 4 x 9 = 36 slots
    assert sizes(100, 167) == (1, 1)  # never fewer than one slot
