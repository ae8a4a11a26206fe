"""The target's identity: its part of the run fingerprint, so that a resume against a different
model, tokenizer or chat template is refused.

It names content, not places: a run whose generated shards move to another machine (a fresh GPU
node after a preemption, the next session's node) resumes there as long as the model is the
same, wherever its folder or the converted GGUF's cache lies.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from tasks.target.model_dir import (
    TargetError,
    context_length_of,
    read_model_config,
    resolve_model_dir,
)
from tasks.target.path_kinds import looks_like_hub_id

# Vocabulary files of the tokenizer formats that have no tokenizer.json.
_VOCAB_FILES = (
    "tokenizer.model",
    "tiktoken.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_WEIGHT_SAMPLE_BYTES = 1024 * 1024


def _sha256_files(paths: list[Path], extra: bytes = b"") -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    digest.update(extra)
    return digest.hexdigest()


def _safetensors_identity(path: Path) -> bytes:
    """The header (every tensor's name, dtype, shape, offsets) and the first MiB of data."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise TargetError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_SAFETENSORS_HEADER:
            raise TargetError(f"{path}: safetensors header of {size} bytes is not plausible")
        header = f.read(size)
        return header + hashlib.sha256(f.read(_WEIGHT_SAMPLE_BYTES)).digest()


def weights_digest(model_dir: Path) -> str:
    """sha256 of config.json, the weight index and every weight file's header and first MiB.

    A cheap identity of a checkpoint that may be a terabyte: headers catch any change of
    layout, the data sample catches new weights of the same shapes (a retrained checkpoint
    differs from its first bytes on), without reading the whole of it.
    """
    digest = hashlib.sha256()
    read_model_config(model_dir)  # a clear error when it is missing or broken
    digest.update(b"config.json\0" + (model_dir / "config.json").read_bytes())
    for index in sorted(model_dir.glob("*.index.json")):
        digest.update(index.name.encode() + b"\0" + index.read_bytes())
    for shard in sorted(model_dir.glob("*.safetensors")):
        digest.update(shard.name.encode() + b"\0" + _safetensors_identity(shard))
    for shard in sorted([*model_dir.glob("*.bin"), *model_dir.glob("*.pt")]):
        with shard.open("rb") as f:
            sample = hashlib.sha256(f.read(_WEIGHT_SAMPLE_BYTES)).hexdigest()
        digest.update(f"{shard.name}\0{shard.stat().st_size}\0{sample}".encode())
    return "sha256:" + digest.hexdigest()


def tokenizer_hash(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of tokenizer.json, or of the vocabulary files plus the added tokens."""
    unified = model_dir / "tokenizer.json"
    if unified.is_file():
        return hashlib.sha256(unified.read_bytes()).hexdigest()
    files = sorted(
        {p for name in _VOCAB_FILES if (p := model_dir / name).is_file()}
        | set(model_dir.glob("*.tiktoken"))
    )
    added = sorted((int(i), str(t)) for i, t in tokenizer.added_tokens_decoder.items())
    extra = json.dumps(added).encode()
    if not files:
        extra += json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    return _sha256_files(files, extra)


def chat_template_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template
    if not template:
        raise TargetError("the tokenizer has no chat template to hash")
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _is_local_path(model_path: str) -> bool:
    """A folder or file on this machine, as opposed to a name that resolves anywhere."""
    return "://" not in model_path and (
        not looks_like_hub_id(model_path) or Path(model_path).expanduser().exists()
    )


def target_identity(
    model_path: str, revision: str | None, tokenizer: PreTrainedTokenizerBase
) -> dict[str, Any]:
    """The target's part of the run fingerprint.

    `model_path` is part of it when it is a name (a hub id, `package://`, `multipart://`) or
    when a named revision stands for the weights; a local path with the weights' own digest is
    not, since the same folder lies elsewhere on another machine.
    """
    model_dir = resolve_model_dir(model_path, revision)
    identity: dict[str, Any] = {}
    if revision is not None or not _is_local_path(model_path):
        identity["model_path"] = model_path
    identity |= {
        "revision": revision or weights_digest(model_dir),
        "tokenizer_hash": tokenizer_hash(model_dir, tokenizer),
        "chat_template_hash": chat_template_hash(tokenizer),
        "context_length": context_length_of(read_model_config(model_dir)),
    }
    source = model_dir / "eaglescale_source.json"
    if source.is_file():  # a converted GGUF: the file it came from, and how it was converted
        info = json.loads(source.read_text(encoding="utf-8"))
        identity["converted_from"] = {k: info[k] for k in ("gguf_sha256", "converter_version")}
    return identity
