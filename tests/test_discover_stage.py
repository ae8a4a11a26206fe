"""The stage on the tiny target: its token counter, the committed tables and their marker."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tasks.config import DiscoverConfig, EagleScaleConfig, SourceConfig
from tasks.discover import discover_prompts
from tasks.discover.commit import TABLES, read_prompts_table
from tasks.discover.stage import run_discover_stage
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import DISCOVERY_MARKER
from tasks.runfolder.shards import sha256_hex
from tasks.target.tokenizer import count_prompt_tokens, load_tokenizer, render_prompt_ids

LENGTH_WARNING = "Token indices sequence length is longer than the specified maximum"


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def q(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_length_check_does_not_print_the_tokenizers_length_warning(
    tiny_target_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    tokenizer = load_tokenizer(str(tiny_target_dir))
    tokenizer.model_max_length = 32  # the tiny target's own 2048 is never reached here
    long_prompt = "please summarize this sentence again " * 20
    path = write_jsonl(tmp_path / "s.jsonl", [q(long_prompt), q("a short question")])
    cfg = DiscoverConfig(
        sources=[SourceConfig(name="s", path=path, domain="d")],
        max_prompt_tokens=24,
        holdout_per_domain=0,
    )
    records = _Records()
    transformers_log = logging.getLogger("transformers")  # it does not propagate to the root
    transformers_log.addHandler(records)
    try:
        result = discover_prompts(cfg, count_prompt_tokens(tokenizer))
        assert result.report["totals"]["too_long"] == 1
        [too_long] = result.filtered.to_pylist()
        assert too_long["n_tokens"] > tokenizer.model_max_length
        assert not any(LENGTH_WARNING in m for m in records.messages)
        assert LENGTH_WARNING not in capfd.readouterr().err
        # Outside discovery's length check the warning stays: the same call warns.
        render_prompt_ids(tokenizer, [{"role": "user", "content": long_prompt}])
        assert any(LENGTH_WARNING in m for m in records.messages)
    finally:
        transformers_log.removeHandler(records)


def test_committed_tables_include_filtered_under_the_marker(tiny_target_dir: Path, tmp_path: Path) -> None:
    rows = [q("a prompt that is kept here"), q("a prompt that is kept here"), q("ok"), {"bad": 1}]
    tokenizer = load_tokenizer(str(tiny_target_dir))
    count = count_prompt_tokens(tokenizer)
    assert count(rows[2]["messages"]) < count(rows[0]["messages"])
    cfg = EagleScaleConfig.model_validate(
        {
            "run_root": str(tmp_path / "run"),
            "target": {"model_path": str(tiny_target_dir)},
            "discover": {
                "sources": [{"name": "s", "path": write_jsonl(tmp_path / "s.jsonl", rows), "domain": "d"}],
                "holdout_per_domain": 0,
                "min_prompt_tokens": count(rows[0]["messages"]),
            },
        }
    )
    run = RunFolder(cfg.run_root)
    out = run_discover_stage(cfg, run, tokenizer)
    marker = run.read_json(DISCOVERY_MARKER)
    assert set(marker["files"]) == set(TABLES) == {"manifest", "holdout", "quarantine", "filtered"}
    entry = marker["files"]["filtered"]
    assert entry["path"] == "prompts/filtered.parquet" and entry["rows"] == 2
    assert sha256_hex(run.read_bytes(entry["path"])) == entry["sha256"]
    filtered = read_prompts_table(run, "filtered").to_pylist()
    assert sorted(f["reason"] for f in filtered) == ["duplicates_exact", "too_short"]
    assert out["report"]["totals"]["duplicates_exact"] == 1
    assert "prompts/filtered.parquet" in out["report_md"]
    # The marker's sha256 covers the new table like the others: a changed file is refused.
    table = pq.read_table(run.path(entry["path"]))
    pq.write_table(table.slice(0, 1), run.path(entry["path"]))
    with pytest.raises(RuntimeError, match="filtered.parquet: sha256 does not match"):
        read_prompts_table(run, "filtered")
