"""Read the rows of one configured source, streaming, through fsspec (so s3:// works).

A source is a file, a glob, a folder of data files, a `datasets` folder written by
`save_to_disk` (read straight from its Arrow stream files, batch by batch, so a remote folder is
never downloaded whole), or a `package://` path to a file inside an installed Python package.
Rows come out in a fixed order (files sorted by path) with their position in the source. A line
that is not JSON is a row-level problem (`RawRow.error`); a source that cannot be opened or
parsed as a whole is a config problem (`SourceError`).

A `.json` array is parsed one element at a time, so memory holds one row, not the file's whole
object tree, and `max_rows` reads only the start of a large file. A file that ends inside the
array (a cut download, or a package that ships a truncated copy) is read like a JSON-lines file
cut mid-line: the complete rows count, the cut one is a row-level error, and `warnings` says so.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import posixpath
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, get_args

import fsspec
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from fsspec.core import OpenFile, url_to_fs
from fsspec.utils import infer_compression

from tasks.config import ConfigError, SourceConfig
from tasks.config import FileFormat as FileFormatName
from tasks.redaction import redact_url
from tasks.target.packages import PackagePathError, is_package_path, resolve_package_path

Rows = Iterator[tuple[Any, str | None, str | None]]  # (parsed row, row error, raw text)


@dataclass(frozen=True)
class FileFormat:
    """One data file format: its name (`file_format`), the extensions that select it under
    `file_format: auto` (after a compression suffix is taken off), and its reader (an open
    binary file, its name, the source's warnings list -> rows)."""

    name: str
    extensions: tuple[str, ...]
    read: Callable[[Any, str, list[str]], Rows]


def _parquet_rows(f: Any, _name: str, _warnings: list[str]) -> Rows:
    for batch in pq.ParquetFile(f).iter_batches(batch_size=_BATCH_ROWS):
        for row in batch.to_pylist():
            yield row, None, None


def _arrow_stream_rows(f: Any, _name: str, _warnings: list[str]) -> Rows:
    for batch in ipc.open_stream(f):
        for row in batch.to_pylist():
            yield row, None, None


# Every file format. A new one is one entry here (and its name in tasks/config/sections.py's
# FileFormat, which the check below keeps equal). hf_disk (a save_to_disk folder) is a layout, not a file
# format: its files are Arrow streams (HF_ARROW), never picked by extension.
FILE_FORMATS = (
    FileFormat("jsonl", (".jsonl", ".ndjson"), lambda f, name, _w: _jsonl_rows(f, name)),
    FileFormat("json", (".json",), lambda f, name, w: _json_rows(f, name, w)),
    FileFormat("parquet", (".parquet", ".pq"), _parquet_rows),
)
HF_ARROW = FileFormat("hf_arrow", (), _arrow_stream_rows)
_READERS = {f.name: f for f in (*FILE_FORMATS, HF_ARROW)}
_EXTENSION_FORMATS = {ext: f.name for f in FILE_FORMATS for ext in f.extensions}
if {f.name for f in FILE_FORMATS} | {"hf_disk"} != set(get_args(FileFormatName)) - {"auto"}:
    raise ImportError(f"file formats {sorted(_READERS)} != config's {get_args(FileFormatName)}")
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_BATCH_ROWS = 1024
_JSON_CHUNK_BYTES = 1 << 20
_HF_DICT_FILE = "dataset_dict.json"
_HF_STATE_FILE = "state.json"


def _extension_format(path: str) -> str | None:
    name = path.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    return _EXTENSION_FORMATS.get(posixpath.splitext(name)[1])


class SourceError(ConfigError):
    """A source that cannot be read at all; the message names the source and the path."""


@dataclass(frozen=True)
class RawRow:
    row_index: int  # position in the source, counting every row (good or not)
    row: Any  # the parsed row; None when it could not be parsed
    error: str | None = None  # why it could not be parsed (bad JSON, bad UTF-8)
    raw_text: str | None = None  # the unparsable text as read


@dataclass(frozen=True)
class _Plan:
    fs: fsspec.AbstractFileSystem
    files: list[tuple[str, str]]  # (fs path, format) in read order


class SourceReader:
    """Resolves one source to files and yields its rows."""

    def __init__(self, src: SourceConfig, storage_options: dict[str, Any] | None = None) -> None:
        self.src = src
        self.storage_options = dict(storage_options or {})
        self.warnings: list[str] = []  # whole-file observations made while reading (truncation)
        self._plan_cache: _Plan | None = None

    def fail(self, what: str, file: str | None = None) -> SourceError:
        where = self.src.path if file is None or file == self.src.path else file
        message = redact_url(f"source {self.src.name!r} ({where}): {what}")
        # Drivers quote the parsed URL in their own words (e.g. `user:secret@bucket` as a bucket
        # name), so the credentials themselves are blanked wherever they appear.
        userinfo = re.search(r"//([^/@\s]+)@", self.src.path)
        if userinfo:
            message = message.replace(userinfo.group(1), "***")
        return SourceError(message)

    def _format_of(self, path: str) -> str:
        if self.src.file_format != "auto":
            return self.src.file_format
        fmt = _extension_format(path)
        if fmt is None:
            names = ", ".join([f.name for f in FILE_FORMATS] + ["hf_disk"])
            raise self.fail(f"cannot tell the file format from the extension; set file_format ({names})", path)
        return fmt

    def plan(self) -> _Plan:
        """The files to read; resolved once, so checking every source up front costs nothing."""
        if self._plan_cache is None:
            self._plan_cache = self._resolve()
        return self._plan_cache

    def _resolve(self) -> _Plan:
        url, options = self.src.path, self.storage_options
        if is_package_path(url):
            try:
                url, options = str(resolve_package_path(url)), {}
            except PackagePathError as e:
                raise self.fail(str(e)) from None
        # Any failure here is the source's (filesystem drivers raise their own exception types).
        try:
            fs, root = url_to_fs(url, **options)
        except Exception as e:
            raise self.fail(f"cannot open the filesystem: {type(e).__name__}: {e}") from None
        try:
            return self._plan(fs, root)
        except SourceError:
            raise
        except Exception as e:
            raise self.fail(f"{type(e).__name__}: {e}") from None

    def _plan(self, fs: fsspec.AbstractFileSystem, root: str) -> _Plan:
        if fs.exists(posixpath.join(root, _HF_DICT_FILE)) or fs.exists(
            posixpath.join(root, _HF_STATE_FILE)
        ):
            if self.src.file_format not in ("auto", "hf_disk"):
                raise self.fail(f"is a datasets folder, but file_format is {self.src.file_format}")
            return _Plan(fs, self._hf_files(fs, root))
        if self.src.file_format == "hf_disk":
            raise self.fail(
                f"is not a save_to_disk folder (no {_HF_DICT_FILE} or {_HF_STATE_FILE})"
            )
        if self.src.split is not None:
            raise self.fail(
                f"split {self.src.split!r} is set, but only a datasets folder has splits"
            )
        if any(ch in root for ch in "*?["):
            found = fs.glob(root, detail=True)
            files = sorted(p for p, info in found.items() if info.get("type") == "file")
            if not files:
                raise self.fail("no files match this glob")
            return _Plan(fs, [(p, self._format_of(p)) for p in files])
        if fs.isdir(root):
            names = sorted(fs.find(root, maxdepth=1))
            auto = self.src.file_format == "auto"
            files = [p for p in names if not auto or _extension_format(p) is not None]
            if not files:
                kinds = [f.extensions[0] for f in FILE_FORMATS]
                raise self.fail(f"folder holds no {', '.join(kinds[:-1])} or {kinds[-1]} files")
            return _Plan(fs, [(p, self._format_of(p)) for p in files])
        if not fs.exists(root):
            raise self.fail("path does not exist")
        return _Plan(fs, [(root, self._format_of(root))])

    def _hf_files(self, fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[str, str]]:
        split_dir = root
        dict_path = posixpath.join(root, _HF_DICT_FILE)
        if fs.exists(dict_path):
            splits = json.loads(fs.cat_file(dict_path)).get("splits", [])
            split = self.src.split
            if split is None:
                if len(splits) != 1:
                    raise self.fail(f"is a DatasetDict with splits {splits}; set split")
                split = splits[0]
            if split not in splits:
                raise self.fail(f"split {split!r} not found (splits: {splits})")
            split_dir = posixpath.join(root, split)
        state_path = posixpath.join(split_dir, _HF_STATE_FILE)
        if not fs.exists(state_path):
            raise self.fail(f"missing {_HF_STATE_FILE}", state_path)
        state = json.loads(fs.cat_file(state_path))
        saved_split = state.get("_split")
        if split_dir == root and self.src.split and saved_split and saved_split != self.src.split:
            raise self.fail(f"holds split {saved_split!r}, not {self.src.split!r}")
        data_files = [d["filename"] for d in state.get("_data_files", [])]
        if not data_files:
            raise self.fail(f"{_HF_STATE_FILE} lists no data files", state_path)
        return [(posixpath.join(split_dir, name), HF_ARROW.name) for name in data_files]

    def rows(self) -> Iterator[RawRow]:
        """Every row of the source in order, at most `max_rows` of them."""
        plan = self.plan()
        index = 0
        limit = self.src.max_rows
        for path, fmt in plan.files:
            if limit is not None and index >= limit:
                return
            with contextlib.closing(self._file_rows(plan.fs, path, fmt)) as file_rows:
                for parsed, error, raw_text in file_rows:
                    yield RawRow(index, parsed, error, raw_text)
                    index += 1
                    if limit is not None and index >= limit:
                        return

    def _file_rows(
        self, fs: fsspec.AbstractFileSystem, path: str, fmt: str
    ) -> Iterator[tuple[Any, str | None, str | None]]:
        compression = None if fmt == HF_ARROW.name else infer_compression(path)
        opener = OpenFile(fs, path, mode="rb", compression=compression)
        with self._errors(path), opener as f:
            yield from _READERS[fmt].read(f, posixpath.basename(path), self.warnings)

    @contextlib.contextmanager
    def _errors(self, path: str) -> Iterator[None]:
        try:
            yield
        except SourceError:
            raise
        except FileNotFoundError:
            raise self.fail("file not found", path) from None
        except Exception as e:
            # A whole-file failure (corrupt parquet, a .json array that does not parse, a
            # driver error): the source is unusable; row-level problems never get here.
            raise self.fail(f"cannot read: {type(e).__name__}: {e}", path) from None


def _jsonl_rows(f: Any, name: str) -> Iterator[tuple[Any, str | None, str | None]]:
    for lineno, line in enumerate(f, start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield (
                None,
                f"invalid UTF-8 at line {lineno} of {name}: {e.reason}",
                line.decode("utf-8", "replace"),
            )
            continue
        text = text.rstrip("\r\n")
        if lineno == 1:
            text = text.lstrip("\ufeff")
        if not text.strip():
            continue
        try:
            yield json.loads(text), None, None
        except json.JSONDecodeError as e:
            yield None, f"invalid JSON at line {lineno} of {name}: {e.msg} (column {e.colno})", text


def _json_rows(
    f: Any, name: str, warnings: list[str]
) -> Iterator[tuple[Any, str | None, str | None]]:
    """A `.json` file is either one JSON array of rows or, as often in the wild, JSON lines."""
    head = f.read(_JSON_CHUNK_BYTES)
    if head.startswith(codecs.BOM_UTF8):
        head = head[len(codecs.BOM_UTF8) :]
    if not head.lstrip(b" \t\r\n").startswith(b"["):
        yield from _jsonl_rows((head + f.read()).splitlines(keepends=True), name)
        return
    yield from _JsonArray(f, name, head, warnings).rows()


_WHITESPACE = re.compile(r"[ \t\r\n]*")
_NUMBER_PREFIX = re.compile(r"-?\d*(\.\d*)?([eE][-+]?\d*)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")


def _cut_inside_value(err: json.JSONDecodeError, text: str) -> bool:
    """Whether `err`, raised on `text` that runs to the end of the file, means the file ends
    inside the value (more bytes could complete it) rather than a syntax error inside it."""
    if err.msg.startswith("Unterminated string"):  # raised only at the end of the input
        return True
    if err.msg.startswith("Invalid \\uXXXX escape"):  # "\u12" + end of file
        return len(text) - err.pos <= 6
    tail = text[err.pos :].strip()
    return (
        not tail
        or any(lit.startswith(tail) for lit in _LITERALS)
        or _NUMBER_PREFIX.fullmatch(tail) is not None
    )


class _JsonArray:
    """The elements of a top-level JSON array, decoded from the stream one at a time."""

    def __init__(self, f: Any, name: str, head: bytes, warnings: list[str]) -> None:
        self.f, self.name, self.warnings = f, name, warnings
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf = self.decoder.decode(head)
        self.pos = _WHITESPACE.match(self.buf).end() + 1  # past "["
        self.eof = False
        self.cut_mid_character = False

    def _more(self) -> None:
        """Read on; at least as much again as is pending, so one huge row is read in O(size)."""
        data = self.f.read(max(_JSON_CHUNK_BYTES, len(self.buf) - self.pos))
        if data:
            text = self.decoder.decode(data)
        else:
            self.eof = True
            try:
                text = self.decoder.decode(b"", final=True)
            except UnicodeDecodeError:  # the file ends in half a character: it was cut
                text, self.cut_mid_character = "", True
        self.buf = self.buf[self.pos :] + text
        self.pos = 0

    def _at_data(self) -> bool:
        """Skip whitespace; False at the end of the file."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return True
            if self.eof:
                return False
            self._more()

    def _cut(self, rows: int, inside_row: bool) -> tuple[None, str, str] | None:
        """Record that the file ends early; the cut row (if any) as a row-level error."""
        where = f"inside row {rows}" if inside_row else "before the JSON array is closed"
        self.warnings.append(
            f"{self.name} ends {where} (a truncated file?); the {rows} complete row(s) before "
            "it are read"
        )
        if not inside_row:
            return None
        reason = f"truncated: {self.name} ends inside this row (a cut file?)"
        return None, reason, self.buf[self.pos :]

    def rows(self) -> Iterator[tuple[Any, str | None, str | None]]:
        decode = json.JSONDecoder().raw_decode
        n = 0
        need_value = False  # right after a comma
        while True:
            if not self._at_data():
                self._cut(n, inside_row=False)
                return
            ch = self.buf[self.pos]
            if not need_value and ch == "]":
                return  # what follows the array is not read
            if n and not need_value:
                if ch != ",":
                    raise ValueError(f"invalid JSON array: expected ',' or ']' after row {n - 1}")
                self.pos += 1
                need_value = True
                continue
            try:
                value, end = decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if not self.eof:
                    self._more()
                    continue
                pending = self.buf[self.pos :]
                shifted = json.JSONDecodeError(e.msg, pending, e.pos - self.pos)
                if not (self.cut_mid_character or _cut_inside_value(shifted, pending)):
                    raise ValueError(f"invalid JSON in row {n} of the array: {e.msg}") from None
                value, end = self._cut(n, inside_row=True), -1
            if end == len(self.buf):
                if not self.eof:
                    self._more()  # a number at the end of the buffer may go on
                    continue
                if isinstance(value, int | float) and not isinstance(value, bool):
                    value, end = self._cut(n, inside_row=True), -1  # "12" + end: maybe "123"
            if end < 0:
                yield value
                return
            yield value, None, None
            n += 1
            need_value = False
            self.pos = end
