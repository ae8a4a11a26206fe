"""discover.holdout_from: a later run, on grown data, is gated on the earlier run's held-out prompts.

Every test runs the real stage on the tiny target's tokenizer over small sources in tmp_path.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tasks.config import ConfigError, EagleScaleConfig, check_input_paths, load_config
from tasks.discover import MANIFEST_SCHEMA, DiscoverConfigError, prompt_id_of
from tasks.discover.commit import read_prompts_table
from tasks.discover.stage import run_discover_stage
from tasks.runfolder import FingerprintMismatch, RunFolder
from tasks.target.tokenizer import load_tokenizer

TOPICS = ["rivers", "engines", "gardens", "comets", "violins", "glaciers", "markets", "bridges"]


def chat(topic: str, turns: int = 3) -> dict[str, Any]:
    """A multi-turn conversation: user, assistant, user, ... ending with an assistant turn."""
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t} about {topic}: why and how?"})
        messages.append({"role": "assistant", "content": f"Answer {t} about {topic}."})
    return {"messages": messages}


def topic_of(messages_json: str) -> str:
    return json.loads(messages_json)[0]["content"].split()[3].rstrip(":")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir: Path) -> Any:
    return load_tokenizer(str(tiny_target_dir))


def config(
    tiny_target_dir: Path, root: Path, sources: list[dict[str, Any]], **discover: Any
) -> EagleScaleConfig:
    return EagleScaleConfig.model_validate(
        {
            "run_root": str(root),
            "target": {"model_path": str(tiny_target_dir)},
            "discover": {"sources": sources, "holdout_per_domain": 2, "seed": 3, **discover},
        }
    )


def source(path: str, prompt_turns: str, name: str = "chats") -> dict[str, Any]:
    return {"name": name, "path": path, "domain": "chat", "prompt_turns": prompt_turns}


def discover(cfg: EagleScaleConfig, tokenizer: Any) -> tuple[dict[str, Any], RunFolder]:
    run = RunFolder(cfg.run_root)
    return run_discover_stage(cfg, run, tokenizer), run


def rows(run: RunFolder, table: str) -> list[dict[str, Any]]:
    return read_prompts_table(run, table).to_pylist()


def held_ids(run: RunFolder) -> list[str]:
    return sorted(r["prompt_id"] for r in rows(run, "holdout"))


@pytest.fixture
def first_run(tmp_path: Path, tiny_target_dir: Path, tokenizer: Any) -> tuple[str, RunFolder]:
    """A run on the first user turn of each chat: the held-out set to keep."""
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(t) for t in TOPICS])
    cfg = config(tiny_target_dir, tmp_path / "first", [source(path, "first_user")])
    _, run = discover(cfg, tokenizer)
    return path, run


def test_every_user_run_keeps_the_first_user_runs_holdout_and_its_conversations_out(
    tmp_path: Path, tiny_target_dir: Path, tokenizer: Any, first_run: tuple[str, RunFolder]
) -> None:
    path, first = first_run
    every = [source(path, "every_user")]
    # Unpinned, the grown pool (3 prompts per chat) gives another seeded pick.
    fresh, fresh_run = discover(config(tiny_target_dir, tmp_path / "fresh", every), tokenizer)
    assert held_ids(fresh_run) != held_ids(first)
    out, run = discover(
        config(tiny_target_dir, tmp_path / "second", every, holdout_from=first.url), tokenizer
    )
    assert held_ids(run) == held_ids(first) and len(held_ids(first)) == 2
    # Nothing of a held-out conversation is trained on: its later turns are contaminated.
    held_topics = {topic_of(r["messages"]) for r in rows(first, "holdout")}
    manifest = rows(run, "manifest")
    assert len(manifest) == 3 * len(TOPICS) - 3 * len(held_topics)
    assert not {topic_of(r["messages"]) for r in manifest} & held_topics
    by_id = {r["prompt_id"]: r for r in rows(first, "holdout")}
    contaminated = [f for f in rows(run, "filtered") if f["reason"] == "contaminated"]
    assert sorted((f["row_index"], f["user_turn"]) for f in contaminated) == sorted(
        (TOPICS.index(topic), turn) for topic in held_topics for turn in (2, 3)
    )
    for f in contaminated:
        assert f["duplicate_of"] in by_id
        assert f["detail"] == (
            f"from the conversation of held-out {f['duplicate_of']} (chats row {f['row_index']} turn 1)"
        )
    report = out["report"]
    assert report["settings"]["holdout_from"] == first.url
    assert report["settings"]["holdout_per_domain"] == 2
    assert report["holdout"]["per_domain"] == {"chat": 2}
    assert report["holdout"]["from"]["carried_per_domain"] == {}
    assert report["totals"]["contaminated"] == 4
    assert f"held-out set from holdout_from {first.url} (chat 2;" in out["report_md"]
    assert fresh["report"]["holdout"]["from"] is None


def test_the_parquet_file_pins_like_the_run_root(
    tmp_path: Path, tiny_target_dir: Path, tokenizer: Any, first_run: tuple[str, RunFolder]
) -> None:
    path, first = first_run
    table = f"{first.url}/prompts/holdout.parquet"
    every = [source(path, "every_user")]
    _, by_root = discover(
        config(tiny_target_dir, tmp_path / "root", every, holdout_from=first.url), tokenizer
    )
    out, by_file = discover(
        config(tiny_target_dir, tmp_path / "file", every, holdout_from=table), tokenizer
    )
    for name in ("holdout", "manifest", "filtered"):
        assert rows(by_file, name) == rows(by_root, name)
    assert out["report"]["holdout"]["from"]["table"] == table


def test_a_held_out_prompt_no_longer_read_is_still_held_out_and_named(
    tmp_path: Path, tiny_target_dir: Path, tokenizer: Any
) -> None:
    chats = write_jsonl(tmp_path / "chats.jsonl", [chat(t) for t in TOPICS[:4]])
    extra = write_jsonl(tmp_path / "extra.jsonl", [chat(t) for t in TOPICS[4:]])
    both = [source(chats, "first_user"), source(extra, "first_user", name="extra")]
    _, first = discover(
        config(tiny_target_dir, tmp_path / "first", both, holdout_per_domain=4), tokenizer
    )
    from_extra = sorted(r["prompt_id"] for r in rows(first, "holdout") if r["source"] == "extra")
    assert from_extra  # the seed holds out some of the source the second run drops
    out, run = discover(
        config(
            tiny_target_dir,
            tmp_path / "second",
            [source(chats, "every_user")],
            holdout_from=first.url,
            holdout_per_domain=4,
        ),
        tokenizer,
    )
    # The benchmark does not shrink: the rows not read here are the earlier run's, verbatim.
    assert rows(run, "holdout") == rows(first, "holdout")
    [warning] = [w for w in out["report"]["warnings"] if w.startswith("holdout_from:")]
    assert warning.startswith(
        f"holdout_from: {len(from_extra)} of 4 held-out prompt(s) are not among this run's "
        f"candidates (0 read and filtered, {len(from_extra)} not read) and are held out as "
        f"{first.url}/prompts/holdout.parquet records them: "
    )
    assert all(prompt_id in warning for prompt_id in from_extra)
    holdout = out["report"]["holdout"]
    assert holdout["per_domain"] == {"chat": 4} and holdout["total"] == 4
    assert holdout["from"]["carried_per_domain"] == {"chat": len(from_extra)}
    # The funnel counts only rows read here; the carried rows are no row of it.
    assert out["report"]["totals"]["holdout"] == 4 - len(from_extra)


def test_a_candidate_with_a_held_out_prompts_text_is_contaminated(
    tmp_path: Path, tiny_target_dir: Path, tokenizer: Any, first_run: tuple[str, RunFolder]
) -> None:
    path, first = first_run
    [pinned, *_] = rows(first, "holdout")
    text = json.loads(pinned["messages"])[0]["content"]
    variant = {"messages": [{"role": "user", "content": text.upper()}]}
    # The held-out prompt's own source is gone; a normalized copy of it comes from another.
    other = write_jsonl(tmp_path / "other.jsonl", [variant, chat("lanterns")])
    _, run = discover(
        config(
            tiny_target_dir,
            tmp_path / "second",
            [source(other, "every_user", name="other")],
            holdout_from=first.url,
        ),
        tokenizer,
    )
    assert held_ids(run) == held_ids(first)
    [copy] = [f for f in rows(run, "filtered") if f["reason"] == "contaminated"]
    assert (copy["row_index"], copy["duplicate_of"]) == (0, pinned["prompt_id"])
    assert copy["detail"] == (
        f"normalized text equals held-out {pinned['prompt_id']} (not read in this run)"
    )


def test_a_held_out_prompt_filtered_here_still_keeps_its_later_turns_out(
    tmp_path: Path, tiny_target_dir: Path, tokenizer: Any
) -> None:
    """The second run's script filter drops every (Korean) first turn, held-out ones included;
    a later turn, with more English after it, passes the filter and still holds the prompt."""
    chats = []
    for topic in TOPICS:
        first_turn = {"role": "user", "content": f"{topic} 에 대한 한국어 질문입니다"}
        chats.append({"messages": [first_turn, *chat(topic, turns=2)["messages"][1:]]})
    path = write_jsonl(tmp_path / "chats.jsonl", chats)

    def row_of(r: dict[str, Any]) -> int:  # the topic leads the Korean first turn
        return TOPICS.index(json.loads(r["messages"])[0]["content"].split()[0])

    _, first = discover(
        config(tiny_target_dir, tmp_path / "first", [source(path, "first_user")]), tokenizer
    )
    every = {**source(path, "every_user"), "min_latin_fraction": 0.7}
    out, run = discover(
        config(tiny_target_dir, tmp_path / "second", [every], holdout_from=first.url), tokenizer
    )
    assert rows(run, "holdout") == rows(first, "holdout")
    assert any("(2 read and filtered, 0 not read)" in w for w in out["report"]["warnings"])
    held_rows = {row_of(r) for r in rows(first, "holdout")}
    by_reason: dict[str, list[tuple[int, int]]] = {}
    for f in rows(run, "filtered"):
        by_reason.setdefault(f["reason"], []).append((f["row_index"], f["user_turn"]))
    assert sorted(by_reason["non_latin"]) == [(i, 1) for i in range(len(TOPICS))]
    assert sorted(by_reason["contaminated"]) == [(i, 2) for i in sorted(held_rows)]
    kept_rows = sorted(row_of(r) for r in rows(run, "manifest"))
    assert kept_rows == sorted(set(range(len(TOPICS))) - held_rows)


def test_a_domain_the_pinned_set_lacks_is_held_out_nowhere_and_the_report_says_so(
    tmp_path: Path, tiny_target_dir: Path, tokenizer: Any, first_run: tuple[str, RunFolder]
) -> None:
    path, first = first_run
    code = write_jsonl(tmp_path / "code.jsonl", [chat(t) for t in ("sorting", "parsing")])
    sources = [
        source(path, "every_user"),
        {**source(code, "every_user", name="code"), "domain": "coding"},
    ]
    out, run = discover(
        config(tiny_target_dir, tmp_path / "second", sources, holdout_from=first.url), tokenizer
    )
    assert held_ids(run) == held_ids(first)
    assert out["report"]["holdout"]["per_domain"] == {"chat": 2, "coding": 0}
    assert (
        "domain 'coding': holdout_from holds none of its prompts, so the gate measures none of it "
        "(holdout_per_domain picks nothing with holdout_from)"
    ) in out["report"]["warnings"]


def test_a_missing_holdout_from_is_named_before_anything_is_written(
    tmp_path: Path, tiny_target_dir: Path, tokenizer: Any
) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(t) for t in TOPICS])
    missing = tmp_path / "no-such-run"
    cfg = config(
        tiny_target_dir,
        tmp_path / "second",
        [source(path, "every_user")],
        holdout_from=str(missing),
    )
    run = RunFolder(cfg.run_root)
    with pytest.raises(
        DiscoverConfigError, match=f"discover.holdout_from: {re.escape(str(missing))}: no such"
    ):
        run_discover_stage(cfg, run, tokenizer)
    assert not run.exists("prompts") and not missing.exists()
    # A run root whose discovery never finished is refused the same way.
    with pytest.raises(DiscoverConfigError, match=r"no committed discovery \(prompts/_SUCCESS"):
        run_discover_stage(cfg.model_copy(update={"discover": cfg.discover.model_copy(
            update={"holdout_from": str(tmp_path)})}), run, tokenizer)  # fmt: skip
    assert not run.exists("prompts")
    # So is one whose marker names no holdout table (written by hand, or by something else).
    (tmp_path / "odd/prompts").mkdir(parents=True)
    (tmp_path / "odd/prompts/_SUCCESS.json").write_text("{}")
    with pytest.raises(DiscoverConfigError, match=r"odd: its prompts/_SUCCESS.json names no holdout table"):
        run_discover_stage(cfg.model_copy(update={"discover": cfg.discover.model_copy(
            update={"holdout_from": str(tmp_path / "odd")})}), run, tokenizer)  # fmt: skip
    assert not run.exists("prompts")


def _table_file(path: Path, table_rows: list[dict[str, Any]], schema: pa.Schema) -> str:
    pq.write_table(pa.Table.from_pylist(table_rows, schema=schema), path)
    return str(path)


def _row(text: str, domain: str = "chat") -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {
        "prompt_id": prompt_id_of(messages),
        "source": "old",
        "domain": domain,
        "messages": json.dumps(messages, separators=(",", ":")),
        "n_tokens": 5,
    }


@pytest.mark.parametrize(
    ("table_rows", "schema", "message"),
    [
        ([], MANIFEST_SCHEMA, "holds no prompts"),
        (
            [{"prompt_id": "x", "messages": "[]"}],
            pa.schema([("prompt_id", pa.string()), ("messages", pa.string())]),
            r"no column\(s\) \['source', 'domain', 'n_tokens'\]: not a holdout table",
        ),
        (
            [_row("a question"), _row("what is code?", domain="coding")],
            MANIFEST_SCHEMA,
            rf"prompt {_row('what is code?')['prompt_id']} has domain 'coding', which no source "
            r"or domain rule of this config gives \(domains: \['chat'\]\)",
        ),
        (
            [{**_row("a question"), "prompt_id": "0" * 20}],
            MANIFEST_SCHEMA,
            f"prompt {'0' * 20}: its messages do not hash to its prompt_id",
        ),
    ],
)
def test_a_table_that_cannot_pin_is_refused_naming_the_file(
    tmp_path: Path,
    tiny_target_dir: Path,
    tokenizer: Any,
    table_rows: list[dict[str, Any]],
    schema: pa.Schema,
    message: str,
) -> None:
    table = _table_file(tmp_path / "holdout.parquet", table_rows, schema)
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(t) for t in TOPICS])
    cfg = config(
        tiny_target_dir, tmp_path / "run", [source(path, "every_user")], holdout_from=table
    )
    run = RunFolder(cfg.run_root)
    with pytest.raises(
        DiscoverConfigError, match=f"discover.holdout_from: {re.escape(table)}: {message}"
    ):
        run_discover_stage(cfg, run, tokenizer)
    assert not run.exists("prompts")


def test_a_changed_holdout_from_or_pinned_set_does_not_reuse_the_marker(
    tmp_path: Path, tiny_target_dir: Path, tokenizer: Any, first_run: tuple[str, RunFolder]
) -> None:
    path, first = first_run
    every = [source(path, "every_user")]
    cfg = config(tiny_target_dir, tmp_path / "second", every, holdout_from=first.url)
    out, _ = discover(cfg, tokenizer)
    assert not out["skipped"]
    assert discover(cfg, tokenizer)[0]["skipped"]  # unchanged: a no-op, as for any discover config
    as_file = cfg.model_copy(
        update={"discover": cfg.discover.model_copy(
            update={"holdout_from": f"{first.url}/prompts/holdout.parquet"})}
    )  # fmt: skip
    assert discover(as_file, tokenizer)[0]["skipped"]  # another spelling of the same held-out set
    moved = tmp_path / "moved"
    shutil.copytree(first.url, moved)  # the earlier run elsewhere (a later session unpacks it anew)
    as_moved = cfg.model_copy(update={"discover": cfg.discover.model_copy(update={"holdout_from": str(moved)})})
    assert discover(as_moved, tokenizer)[0]["skipped"]
    # The same path, but the earlier run rediscovered with another seed: another held-out set.
    first_cfg = config(tiny_target_dir, Path(first.url), [source(path, "first_user")], seed=11)
    pinned_before = held_ids(first)
    redone, _ = discover(first_cfg.model_copy(update={"allow_fingerprint_change": True}), tokenizer)
    assert not redone["skipped"] and held_ids(first) != pinned_before
    with pytest.raises(FingerprintMismatch, match="different discover config"):
        discover(cfg, tokenizer)
    # Allowed to change, discovery reruns on the new held-out set.
    again, run = discover(cfg.model_copy(update={"allow_fingerprint_change": True}), tokenizer)
    assert not again["skipped"] and held_ids(run) == held_ids(first)


def test_a_relative_holdout_from_resolves_against_the_params_file_and_is_checked(
    tmp_path: Path, tiny_target_dir: Path
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "s.jsonl").write_text(json.dumps(chat("rivers")) + "\n")
    params = conf / "p.yaml"
    params.write_text(
        yaml.safe_dump(
            {
                "run_root": "runs/second",
                "target": {"model_path": str(tiny_target_dir)},
                "discover": {
                    "sources": [{"name": "s", "path": "s.jsonl", "domain": "chat"}],
                    "holdout_from": "../runs/first",
                },
            }
        )
    )
    cfg = load_config(params)
    assert cfg.discover.holdout_from == str(tmp_path / "runs/first")
    with pytest.raises(ConfigError) as err:
        check_input_paths(cfg)
    assert (
        f"discover.holdout_from: no run folder or holdout parquet file at {tmp_path / 'runs/first'}"
        in str(err.value)
    )
    (tmp_path / "runs/first").mkdir(parents=True)
    check_input_paths(cfg)
    # Not checked when this process does not discover.
    (tmp_path / "runs/first").rmdir()
    check_input_paths(cfg.model_copy(update={"stages": ["generate"]}))
