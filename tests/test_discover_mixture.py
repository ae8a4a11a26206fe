"""The stage end to end on constructed inputs: dedupe, holdout, decontamination, length, mixture."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from tasks.config import DiscoverConfig, SourceConfig
from tasks.discover import (
    MANIFEST_SCHEMA,
    QUARANTINE_SCHEMA,
    DiscoverConfigError,
    discover_prompts,
    prompt_id_of,
    sample_prompt_sources,
)
from tasks.discover.mixture import largest_remainder
from tasks.discover.report import COUNT_KEYS, OUTCOMES


def words(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) for m in messages)


def q(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def discover(sources: list[SourceConfig], count_tokens=words, **kw: Any):
    kw.setdefault("holdout_per_domain", 0)
    return discover_prompts(DiscoverConfig(sources=sources, **kw), count_tokens)


def domain_counts(result, outcome: str) -> dict[str, int]:
    return {d: c[outcome] for d, c in result.report["domains"].items()}


def assert_funnel_closes(report: dict[str, Any]) -> None:
    for scope in (*report["sources"].values(), *report["domains"].values(), report["totals"]):
        assert scope["rows_read"] == sum(scope[k] for k in OUTCOMES)


def make_domains(tmp_path: Path, sizes: dict[str, int]) -> list[SourceConfig]:
    sources = []
    for domain, n in sizes.items():
        rows = [q(f"{domain} question number {i} about topic {i * 7}") for i in range(n)]
        sources.append(
            SourceConfig(
                name=domain, path=write_jsonl(tmp_path / f"{domain}.jsonl", rows), domain=domain
            )
        )
    return sources


def test_exact_and_normalized_dedupe_counts(tmp_path: Path) -> None:
    rows_a = [
        q("What is a monad?"),
        q("What is a monad?"),  # exact
        {"messages": [{"content": "What is a monad?", "role": "user"}]},  # exact: key order
        q("Explain closures in JavaScript."),
        q("explain closures in javascript"),  # normalized
        q("Explain   closures in JavaScript!!"),  # normalized
        q("Name three sorting algorithms."),
    ]
    rows_b = [
        q("Name three sorting algorithms."),  # exact, across sources and domains
        q("Write a haiku about rain."),
    ]
    sources = [
        SourceConfig(name="a", path=write_jsonl(tmp_path / "a.jsonl", rows_a), domain="zeta"),
        SourceConfig(name="b", path=write_jsonl(tmp_path / "b.jsonl", rows_b), domain="alpha"),
    ]
    result = discover(sources)
    report = result.report
    assert report["totals"]["duplicates_exact"] == 3
    assert report["totals"]["duplicates_normalized"] == 2
    assert report["totals"]["kept"] == 4
    # The cross-domain copy is kept under the smaller domain name, so "zeta" loses it.
    assert report["sources"]["a"]["duplicates_exact"] == 3
    assert report["sources"]["b"]["duplicates_exact"] == 0
    by_text = {
        json.loads(m)[0]["content"]: d
        for m, d in zip(
            result.manifest.column("messages").to_pylist(),
            result.manifest.column("domain").to_pylist(),
            strict=True,
        )
    }
    assert by_text["Name three sorting algorithms."] == "alpha"
    assert_funnel_closes(report)


def test_holdout_and_decontamination_counts(tmp_path: Path) -> None:
    group = ["Is P equal to NP?", "is p equal to np", "Is P  equal to NP??"]
    smallest = min(prompt_id_of(q(t)["messages"]) for t in group)
    # A near-duplicate in the other domain whose id sorts after the group's, so "bench" holds
    # the group's representative whatever the hashes are.
    variants = [
        "IS P EQUAL TO NP?",
        "is P equal to NP...",
        "Is p equal to np?!",
        "IS p EQUAL to NP",
    ]
    other = next(t for t in variants if prompt_id_of(q(t)["messages"]) > smallest)
    bench = [q(group[0]), q(group[1]), q(group[2]), q(group[0])]
    train = [q(f"Distinct training prompt {i} on subject {i * 13}") for i in range(4)]
    train += [q(other), q("Distinct training prompt 0 on subject 0")]
    sources = [
        SourceConfig(
            name="bench", path=write_jsonl(tmp_path / "bench.jsonl", bench), domain="bench"
        ),
        SourceConfig(
            name="train", path=write_jsonl(tmp_path / "train.jsonl", train), domain="train"
        ),
    ]
    result = discover(sources, holdout_per_domain=1, seed=5)
    report = result.report
    nonzero = {
        name: {k: v for k, v in counts.items() if v and k in COUNT_KEYS}
        for name, counts in report["sources"].items()
    }
    assert nonzero == {
        "bench": {"rows_read": 4, "duplicates_exact": 1, "holdout": 1, "contaminated": 2},
        "train": {
            "rows_read": 6,
            "duplicates_exact": 1,
            "holdout": 1,
            "contaminated": 1,
            "kept": 3,
        },
    }
    assert report["holdout"] == {"per_domain": {"bench": 1, "train": 1}, "total": 2, "from": None}
    assert smallest in result.holdout.column("prompt_id").to_pylist()
    kept_texts = [
        json.loads(m)[0]["content"] for m in result.manifest.column("messages").to_pylist()
    ]
    assert other not in kept_texts and not set(group) & set(kept_texts)
    assert not set(result.holdout.column("prompt_id").to_pylist()) & set(
        result.manifest.column("prompt_id").to_pylist()
    )
    assert any("domain 'bench': only 1 distinct prompt(s)" in w for w in report["warnings"])
    assert_funnel_closes(report)


def test_length_filter_and_token_count_failures(tmp_path: Path) -> None:
    rows = [
        q("one"),
        q("two words"),
        q("exactly three words"),
        q("now four words here"),
        q("five words in this one"),
        q("BOOM this template rejects"),
    ]

    def count(messages: list[dict[str, str]]) -> int:
        if messages[0]["content"].startswith("BOOM"):
            raise ValueError("Conversation roles must alternate user/assistant")
        return words(messages)

    src = SourceConfig(name="s", path=write_jsonl(tmp_path / "s.jsonl", rows), domain="d")
    result = discover([src], count, min_prompt_tokens=2, max_prompt_tokens=4)
    totals = result.report["totals"]
    assert (totals["too_short"], totals["too_long"], totals["malformed"], totals["kept"]) == (
        1,
        1,
        1,
        3,
    )
    assert sorted(result.manifest.column("n_tokens").to_pylist()) == [2, 3, 4]
    [bad] = result.quarantine.to_pylist()
    assert bad["row_index"] == 5
    assert (
        bad["reason"]
        == "token count failed: ValueError: Conversation roles must alternate user/assistant"
    )

    def always_fails(messages: list[dict[str, str]]) -> int:
        raise RuntimeError("tokenizer not loaded")

    with pytest.raises(RuntimeError, match="count_tokens failed on all 6 prompts"):
        discover([src], always_fails)


def test_quotas_give_exact_per_domain_counts(tmp_path: Path) -> None:
    sources = make_domains(tmp_path, {"a": 20, "b": 15, "c": 10})
    result = discover(sources, domain_quotas={"a": 7, "b": 15, "c": 12})
    assert domain_counts(result, "kept") == {"a": 7, "b": 15, "c": 10}
    assert domain_counts(result, "over_quota") == {"a": 13, "b": 0, "c": 0}
    assert result.manifest.num_rows == 32
    assert result.report["mixture"]["c"] == {"available": 10, "cap": 12, "kept": 10}
    assert "domain 'c': cap 12, only 10 available" in result.report["warnings"]
    assert_funnel_closes(result.report)


def test_weights_and_proportional_total(tmp_path: Path) -> None:
    sources = make_domains(tmp_path, {"a": 20, "b": 15, "c": 10})
    weighted = discover(sources, total_prompts=20, domain_weights={"a": 0.5, "b": 0.3, "c": 0.2})
    assert domain_counts(weighted, "kept") == {"a": 10, "b": 6, "c": 4}
    assert domain_counts(weighted, "over_quota") == {"a": 10, "b": 9, "c": 6}
    mixed = discover(
        sources, total_prompts=12, domain_quotas={"c": 2}, domain_weights={"a": 1, "b": 1}
    )
    assert domain_counts(mixed, "kept") == {"a": 5, "b": 5, "c": 2}
    proportional = discover(sources, total_prompts=9)
    assert domain_counts(proportional, "kept") == {"a": 4, "b": 3, "c": 2}
    everything = discover(sources)
    assert domain_counts(everything, "kept") == {"a": 20, "b": 15, "c": 10}


def test_largest_remainder_sums_exactly() -> None:
    assert largest_remainder(10, {"a": Fraction(1), "b": Fraction(1), "c": Fraction(1)}) == {
        "a": 4,
        "b": 3,
        "c": 3,
    }
    assert largest_remainder(7, {"x": Fraction(3, 10), "y": Fraction(7, 10)}) == {"x": 2, "y": 5}
    assert largest_remainder(5, {"x": Fraction(0), "y": Fraction(2)}) == {"x": 0, "y": 5}


def test_same_inputs_and_seed_give_identical_output_in_any_order(tmp_path: Path) -> None:
    rows = {
        d: [q(f"{d} prompt {i} with detail {i * 3}") for i in range(30)] for d in ("code", "chat")
    }
    rows["chat"] += [q("chat prompt 1 with detail 3"), q("CHAT prompt 2, with detail 6")]
    rows["code"] += [q("chat prompt 4 with detail 12")]  # cross-domain exact duplicate
    rows["code"].append(["not", "an", "object"])

    def build(folder: Path, order_seed: int | None, seed: int = 3):
        folder.mkdir()
        sources = []
        for d, rs in rows.items():
            rs = list(rs)
            if order_seed is not None:
                random.Random(order_seed).shuffle(rs)
            sources.append(
                SourceConfig(name=d, path=write_jsonl(folder / f"{d}.jsonl", rs), domain=d)
            )
        if order_seed is not None:
            sources.reverse()
        return discover(
            sources, seed=seed, holdout_per_domain=4, domain_quotas={"code": 11, "chat": 9}
        )

    first = build(tmp_path / "first", None)
    again = build(tmp_path / "again", 42)
    assert first.manifest.equals(again.manifest)
    assert first.holdout.equals(again.holdout)
    for key in ("domains", "totals", "holdout", "mixture"):
        assert first.report[key] == again.report[key]
    assert first.manifest.num_rows == 20 and first.holdout.num_rows == 8
    other_seed = build(tmp_path / "other", None, seed=4)
    assert not first.manifest.equals(other_seed.manifest)
    ids = first.manifest.column("prompt_id").to_pylist()
    assert ids == sorted(ids)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"domain_weights": {"a": 1.0}}, "discover.domain_weights needs discover.total_prompts"),
        (
            {"domain_quotas": {"typo": 3}},
            "discover.domain_quotas: domain 'typo' is not the domain of any source",
        ),
        (
            {"domain_weights": {"a": 1.0}, "total_prompts": 5},
            "discover.domain_weights: no weight (or quota) for domain(s) ['b']",
        ),
        ({"domain_quotas": {"a": -1}}, "discover.domain_quotas.a: must be >= 0"),
        (
            {"domain_quotas": {"a": 4, "b": 4}, "total_prompts": 5},
            "discover.domain_quotas: quotas sum to 8, more than discover.total_prompts (5)",
        ),
        (
            {"min_prompt_tokens": 10, "max_prompt_tokens": 5},
            "discover.min_prompt_tokens (10) is above discover.max_prompt_tokens (5)",
        ),
        (
            {"max_prompt_tokens_by_domain": {"coding": 2048}},
            "discover.max_prompt_tokens_by_domain: domain 'coding' is not the domain of any source",
        ),
        (
            {"min_prompt_tokens": 10, "max_prompt_tokens_by_domain": {"a": 5}},
            "discover.max_prompt_tokens_by_domain.a (5) is below discover.min_prompt_tokens (10)",
        ),
    ],
)
def test_config_errors_name_the_field(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    sources = make_domains(tmp_path, {"a": 2, "b": 2})
    with pytest.raises(DiscoverConfigError) as err:
        discover(sources, **kw)
    assert str(err.value).startswith(message)


def test_source_list_errors(tmp_path: Path) -> None:
    with pytest.raises(DiscoverConfigError, match="discover.sources is empty"):
        discover([])
    [src] = make_domains(tmp_path, {"a": 1})
    with pytest.raises(
        DiscoverConfigError,
        match=r"discover.sources\[1\].name 'a' is already used by discover.sources\[0\]",
    ):
        discover([src, src])


def test_shipped_sample_set(tmp_path: Path) -> None:
    result = discover_prompts(DiscoverConfig(sources=sample_prompt_sources()), words)
    report = result.report
    assert set(report["domains"]) == {"agentic_coding", "reasoning", "general_chat"}
    assert report["totals"]["kept"] >= 200
    assert all(c["kept"] >= 60 for c in report["domains"].values())
    assert report["holdout"]["per_domain"] == {
        "agentic_coding": 8,
        "general_chat": 8,
        "reasoning": 8,
    }
    assert (
        report["totals"]["duplicates_exact"] >= 2 and report["totals"]["duplicates_normalized"] >= 2
    )
    assert result.manifest.schema == MANIFEST_SCHEMA and result.holdout.schema == MANIFEST_SCHEMA
    assert result.quarantine.schema == QUARANTINE_SCHEMA
    quarantined = result.quarantine.to_pylist()
    assert {r["source"] for r in quarantined} == {"malformed_examples"}
    assert len(quarantined) == report["sources"]["malformed_examples"]["rows_read"] - 1
    assert all(len(r["raw"].encode()) <= 4096 for r in quarantined)
    multi_turn = [m for m in result.manifest.column("messages").to_pylist() if '"assistant"' in m]
    assert len(multi_turn) >= 10
    assert all(
        json.loads(m)[-1]["role"] == "user" for m in result.manifest.column("messages").to_pylist()
    )
    assert set(report["totals"]) == set(COUNT_KEYS)
    assert_funnel_closes(report)

    markdown = result.report_markdown()
    assert "| domain | read | malformed | non-Latin | dup exact |" in markdown
    for domain in ("agentic_coding", "reasoning", "general_chat"):
        assert f"| {domain} | {report['domains'][domain]['rows_read']} |" in markdown
    assert "messages[1].role 'robot' unknown" in markdown
