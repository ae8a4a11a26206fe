"""Source rules and the row records: script filter, domain rules, dedupe key, the filtered table."""

from __future__ import annotations

import json
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.config import ConfigError, DiscoverConfig, SourceConfig, load_config
from tasks.discover import FILTERED_SCHEMA, DiscoverConfigError, discover_prompts, prompt_id_of
from tasks.discover.report import OUTCOMES, funnel_counts, reason_kinds

REPO = Path(__file__).resolve().parents[1]


def words(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) for m in messages)


def q(text: str, system: str | None = None) -> dict[str, Any]:
    head = [{"role": "system", "content": system}] if system else []
    return {"messages": [*head, {"role": "user", "content": text}]}


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


def discover(sources: list[SourceConfig], **kw: Any):
    kw.setdefault("holdout_per_domain", 0)
    return discover_prompts(DiscoverConfig(sources=sources, **kw), words)


def test_script_filter_records_the_measured_fraction(tmp_path: Path) -> None:
    rows = [
        q("How do I sort a list in Python?"),
        q("파이썬에서 리스트를 정렬하는 방법은?"),
        q("Écris-moi un poème sur l'été, s'il te plaît"),  # accented Latin passes
        q("번역: hello"),  # 2 Hangul syllables, 5 Latin letters: 5/7
        q("1 + 1 = ?"),  # no letters: nothing to measure, passes
        q("Ｆｕｌｌｗｉｄｔｈ letters"),  # fullwidth Latin is Latin
    ]
    src = SourceConfig(
        name="s", path=write_jsonl(tmp_path / "s.jsonl", rows), domain="d", min_latin_fraction=0.9
    )
    result = discover([src])
    kept = sorted(json.loads(m)[0]["content"] for m in result.manifest.column("messages").to_pylist())
    assert kept == sorted([rows[i]["messages"][0]["content"] for i in (0, 2, 4, 5)])
    filtered = result.filtered.to_pylist()
    assert [(f["row_index"], f["reason"], f["latin_fraction"]) for f in filtered] == [
        (1, "non_latin", 0.0),
        (3, "non_latin", pytest.approx(5 / 7)),
    ]
    assert filtered[1]["detail"] == (
        "Latin-script letters are 0.714 of the prompt's letters, below min_latin_fraction 0.9"
    )
    assert filtered[0]["n_tokens"] is None  # dropped before the length check
    assert result.report["sources"]["s"]["non_latin"] == 2
    assert result.report["sources"]["s"]["min_latin_fraction"] == 0.9


def test_domain_rules_split_a_source_and_the_report_counts_both_ways(tmp_path: Path) -> None:
    chat_rows = [
        q("Write a haiku about rain"),
        q("Why does this fail?\n```python\nprint(1/0)\n```"),
        q("Explain: def f(x): return x"),
        # Code in an earlier answer does not make the prompt a coding prompt.
        {
            "messages": [
                {"role": "user", "content": "Show me a loop"},
                {"role": "assistant", "content": "```python\nfor i in range(3): pass\n```"},
                {"role": "user", "content": "Thanks, now a limerick"},
            ]
        },
        q("Tell me a joke"),
    ]
    rule = {"pattern": r"```|\bdef \w+\(", "domain": "coding"}
    chat = SourceConfig(
        name="chat",
        path=write_jsonl(tmp_path / "chat.jsonl", chat_rows),
        domain="general_chat",
        domain_rules=[rule],
    )
    code = SourceConfig(
        name="code", path=write_jsonl(tmp_path / "code.jsonl", [q("Fix my regex please")]), domain="coding"
    )
    result = discover([chat, code], domain_quotas={"coding": 2})
    assert Counter(result.manifest.column("domain").to_pylist()) == {"general_chat": 3, "coding": 2}
    report = result.report
    assert report["source_domains"]["chat"]["coding"]["rows_read"] == 2
    assert report["source_domains"]["chat"]["general_chat"]["rows_read"] == 3
    assert report["domains"]["coding"]["rows_read"] == 3
    assert (report["domains"]["coding"]["kept"], report["domains"]["coding"]["over_quota"]) == (2, 1)
    assert report["sources"]["chat"]["rows_read"] == 5
    assert "| chat | coding | 2 |" in result.report_markdown()
    with pytest.raises(DiscoverConfigError, match="domain 'reasoning' is not the domain of any source or domain rule"):
        discover([chat], domain_quotas={"reasoning": 1})


def test_every_row_left_out_is_a_record_and_the_counts_are_the_records(tmp_path: Path) -> None:
    rows = [
        q("keep me one two"),
        q("keep me one two"),  # duplicates_exact
        q("Keep me, one two!"),  # duplicates_normalized (or contaminated if its twin is held out)
        q("short"),  # too_short
        q("far too many words in this prompt to pass the filter"),  # too_long
        q("이것은 한국어입니다"),  # non_latin
        {"messages": "not a list"},  # malformed
        *[q(f"distinct prompt number {i}") for i in range(8)],  # holdout, kept, over_quota
    ]
    src = SourceConfig(
        name="s", path=write_jsonl(tmp_path / "s.jsonl", rows), domain="d", min_latin_fraction=0.5
    )
    result = discover(
        [src], min_prompt_tokens=2, max_prompt_tokens=6, holdout_per_domain=2, total_prompts=4
    )
    assert result.filtered.schema == FILTERED_SCHEMA
    records = Counter(result.filtered.column("reason").to_pylist())
    records["malformed"] = result.quarantine.num_rows
    records["holdout"] = result.holdout.num_rows
    records["kept"] = result.manifest.num_rows
    counts = result.report["sources"]["s"]
    assert {k: counts[k] for k in OUTCOMES if counts[k]} == dict(records)
    assert counts["rows_read"] == len(rows) == sum(records.values())
    assert set(records) >= {"duplicates_exact", "too_short", "too_long", "non_latin", "over_quota"}
    assert records["duplicates_normalized"] + records["contaminated"] == 1
    by_reason = {f["reason"]: f for f in result.filtered.to_pylist()}
    assert by_reason["too_long"]["detail"] == "11 tokens, above max_prompt_tokens 6"
    assert by_reason["too_long"]["n_tokens"] == 11
    assert by_reason["too_short"]["detail"] == "1 tokens, below min_prompt_tokens 2"
    dup = by_reason["duplicates_exact"]
    assert dup["row_index"] == 1 and dup["duplicate_of"] == dup["prompt_id"]
    assert dup["detail"] == f"same conversation as {dup['prompt_id']} (s row 0)"
    assert by_reason["over_quota"]["detail"] == "domain 'd' keeps 4 of 7 available"
    markdown = result.report_markdown()
    assert "## Filtered (examples of each reason; all 8 in prompts/filtered.parquet)" in markdown
    assert "| s | 4 | too_long | 11 tokens, above max_prompt_tokens 6 |" in markdown


def test_a_domain_with_a_length_cap_of_its_own_keeps_longer_prompts(tmp_path: Path) -> None:
    """ShareGPT code's later turns run to 2,048 tokens where chat's are cut at 1,024 (P28): a
    domain's own cap keeps its longer prompts, the others keep the run's, and a prompt dropped
    names the key that dropped it. Unset, the discover hash is what it was."""
    from tasks.discover.domains import max_prompt_tokens
    from tasks.discover.stage import discover_config_hash

    rows = [q("def one two three four five"), q("chat one two three four five"),
            q("def one two"), q("chat one two"),
            q("def one two three four five six seven eight nine")]  # fmt: skip
    src = SourceConfig(name="s", path=write_jsonl(tmp_path / "s.jsonl", rows), domain="chat",
                       domain_rules=[{"pattern": "^def", "domain": "code"}])  # fmt: skip
    result = discover([src], max_prompt_tokens=4, max_prompt_tokens_by_domain={"code": 7})
    kept = sorted(json.loads(m)[0]["content"] for m in result.manifest.column("messages").to_pylist())
    assert kept == ["chat one two", "def one two", "def one two three four five"]
    dropped = {f["row_index"]: f["detail"] for f in result.filtered.to_pylist()}
    assert dropped == {1: "6 tokens, above max_prompt_tokens 4",
                       4: "10 tokens, above max_prompt_tokens_by_domain.code 7"}  # fmt: skip
    assert result.report["settings"]["max_prompt_tokens_by_domain"] == {"code": 7}
    assert "prompt length 1–4 tokens, code up to 7;" in result.report_markdown()
    cfg = DiscoverConfig(sources=[src], max_prompt_tokens=4, max_prompt_tokens_by_domain={"code": 7})
    assert (max_prompt_tokens(cfg), max_prompt_tokens(cfg, "code"), max_prompt_tokens(cfg, "chat")) == (7, 7, 4)

    # Unset, the key stays out of the discover hash: the Qwen profile's is still the one run 15
    # committed its prompts under, so its carried prompts are not discovered again. Set, it counts.
    profile = load_config(REPO / "deployments/params/qwen25-coder.yaml")
    with tarfile.open(REPO / "benchmarks/results/real-run-node/run-15/generation.tar") as tar:
        committed = json.load(tar.extractfile("run/prompts/_SUCCESS.json"))["config_hash"]
    assert discover_config_hash(profile, None) == committed
    capped = profile.model_copy(update={"discover": profile.discover.model_copy(
        update={"max_prompt_tokens_by_domain": {"coding": 2048}})})  # fmt: skip
    assert discover_config_hash(capped, None) != committed


def chat(*texts: str) -> dict[str, Any]:
    """A conversation alternating user and assistant turns, starting with the user."""
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]}


def test_every_user_turn_is_a_prompt_and_holdout_takes_the_whole_conversation(
    tmp_path: Path,
) -> None:
    rows = [
        chat("alpha one two", "ok", "alpha three four", "ok", "alpha five six"),
        chat("beta one two", "ok", "beta three four", "ok", "beta five six"),
        chat("gamma one two", "", "gamma three four"),  # an empty answer ends its prompts there
        {"messages": "not a list"},
    ]
    src = SourceConfig(
        name="s",
        path=write_jsonl(tmp_path / "s.jsonl", rows),
        domain="chat",
        prompt_turns="every_user",
        domain_rules=[{"pattern": "five", "domain": "long"}],  # by each prompt's own user text
    )
    result = discover([src], holdout_per_domain=1, max_prompt_tokens=100)
    held = result.holdout.to_pylist()
    # One prompt held out per domain; nothing of its conversation is trained on.
    assert sorted(h["domain"] for h in held) == ["chat", "long"]
    held_rows = {json.loads(h["messages"])[0]["content"].split()[0] for h in held}
    trained = [json.loads(m) for m in result.manifest.column("messages").to_pylist()]
    assert not {m[0]["content"].split()[0] for m in trained} & held_rows
    contaminated = [f for f in result.filtered.to_pylist() if f["reason"] == "contaminated"]
    held_ids = {h["prompt_id"] for h in held}
    assert contaminated and all(f["duplicate_of"] in held_ids for f in contaminated)
    assert all(f["detail"].startswith("from the conversation of held-out ") for f in contaminated)
    # Every turn of a conversation not held out is a training prompt through that turn.
    gamma = [m for m in trained if m[0]["content"] == "gamma one two"]
    assert ("gamma" in held_rows) or gamma == [[{"role": "user", "content": "gamma one two"}]]
    for m in trained:
        assert m[-1]["role"] == "user" and len(m) in (1, 3, 5)
    quarantine = result.quarantine.to_pylist()
    assert [(r["row_index"], r["user_turn"], r["reason"]) for r in quarantine] == [
        (2, 2, "messages[1].content is empty"),
        (3, None, "messages is str, expected a list"),
    ]
    # The funnel counts prompts: 3 + 3 + 1 and one row quarantined at its second turn, plus
    # the malformed row; the source had 4 rows.
    counts = result.report["sources"]["s"]
    assert counts["rows_read"] == 9 and counts["source_rows"] == 4
    assert counts["malformed"] == 2 and counts["holdout"] == 2
    assert counts["kept"] + counts["contaminated"] == 5
    assert "9 rows read from 1 source(s) (prompts and quarantined rows from 4 rows" in (
        result.report_markdown()
    )
    assert "| s | 2 turn 2 | messages[1].content is empty |" in result.report_markdown()


def test_counts_that_do_not_close_stop_the_stage() -> None:
    with pytest.raises(RuntimeError, match="source 's' read 3 rows but recorded 2"):
        funnel_counts({"s": ["d"]}, {"s": 3}, [("s", "d", "kept"), ("s", "d", "malformed")])


def test_dedupe_key_user_turns_ignores_system_turns(tmp_path: Path) -> None:
    rows = [
        q("What is the capital of France?"),
        q("What is the capital of France?", system="You are a geography tutor."),
        q("what is the CAPITAL of france", system="Answer in one word."),
    ]
    src = SourceConfig(name="s", path=write_jsonl(tmp_path / "s.jsonl", rows), domain="d")
    by_conversation = discover([src])
    assert by_conversation.manifest.num_rows == 3
    assert by_conversation.report["settings"]["dedupe_key"] == "conversation"
    by_user = discover([src], dedupe_key="user_turns")
    assert by_user.manifest.num_rows == 1
    assert by_user.report["settings"]["dedupe_key"] == "user_turns"
    assert "dedupe key: user_turns" in by_user.report_markdown()
    records = {f["reason"]: f for f in by_user.filtered.to_pylist()}
    assert sorted(records) == ["duplicates_exact", "duplicates_normalized"]
    first = prompt_id_of(rows[0]["messages"])
    exact = records["duplicates_exact"]
    assert (exact["row_index"], exact["duplicate_of"]) == (1, first)
    assert exact["detail"] == f"same user_turns as {first} (s row 0)"
    # The normalized group's representative is its smallest prompt_id, as for conversations.
    [kept_id] = by_user.manifest.column("prompt_id").to_pylist()
    assert records["duplicates_normalized"]["duplicate_of"] == kept_id


def test_template_applies_to_prompt_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "he.jsonl", [{"task_id": "T/0", "prompt": "def f():\n"}])
    src = SourceConfig(
        name="he",
        path=path,
        domain="coding",
        conversation_format="prompt",
        user_template="Complete:\n```python\n{prompt}```",
    )
    [messages] = discover([src]).manifest.column("messages").to_pylist()
    assert json.loads(messages) == [{"role": "user", "content": "Complete:\n```python\ndef f():\n```"}]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"conversation_format": "prompt", "user_template": "Complete this function"},
            "key 'discover.sources.0.user_template': Value error, user_template must contain "
            "{prompt} exactly once (found 0 times)",
        ),
        (
            {"conversation_format": "prompt", "user_template": "{prompt}\n\n{prompt}"},
            "user_template must contain {prompt} exactly once (found 2 times)",
        ),
        (
            {"conversation_format": "prompt", "user_template": "Complete {question}"},
            "user_template has placeholder(s) ['{question}']; the only placeholder is {prompt}",
        ),
        (
            {"user_template": "{prompt}"},
            "user_template is set but conversation_format is 'auto'; it applies to "
            "conversation_format prompt only",
        ),
        (
            {"domain_rules": [{"pattern": "```(", "domain": "coding"}]},
            "key 'discover.sources.0.domain_rules.0.pattern': Value error, pattern '```(' is not "
            "a valid regular expression",
        ),
        ({"min_latin_fraction": 1.5}, "key 'discover.sources.0.min_latin_fraction'"),
        ({"prompt_turns": "first"}, "key 'discover.sources.0.prompt_turns'"),
    ],
)
def test_source_option_errors_name_the_key(
    tmp_path: Path, source: dict[str, Any], message: str
) -> None:
    params = {
        "run_root": str(tmp_path / "run"),
        "target": {"model_path": "unused"},
        "discover": {"sources": [{"name": "s", "path": "x.jsonl", "domain": "d", **source}]},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)
    assert str(err.value).startswith(str(path))


def test_quarantine_reason_kinds_blank_numbers_not_names() -> None:
    assert reason_kinds(
        [
            "conversations[3].value is empty",
            "conversations[12].value is empty",
            "truncated: ShareGPT_V3_unfiltered_cleaned_split.json ends inside this row",
        ]
    ) == {
        "conversations[N].value is empty": 2,
        "truncated: ShareGPT_V3_unfiltered_cleaned_split.json ends inside this row": 1,
    }
