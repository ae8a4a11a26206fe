"""What the pipeline knows about a target model: its tokenizer, prompt rendering and identity.

The generate stage renders prompts to token ids here (engines only ever see ids), discovery
counts prompt tokens here, and the run fingerprint records `target_identity` so that a resume
against a different model, tokenizer or chat template is refused.
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tasks.config import is_template_text, looks_like_hub_id
from tasks.gguf_target import GGUFTargetError, converted_dir
from tasks.packages import PackagePathError, is_package_path, resolve_package_path

# Vocabulary files of the tokenizer formats that have no tokenizer.json.
_VOCAB_FILES = (
    "tokenizer.model",
    "tiktoken.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
# Nested configs of multimodal targets (Kimi-K2.5 keeps its text model under text_config).
_NESTED_CONFIGS = ("text_config", "language_config", "llm_config")
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_WEIGHT_SAMPLE_BYTES = 1024 * 1024


class TargetError(ValueError):
    """The target model folder, its tokenizer or a prompt cannot be used; says which and why."""


def resolve_model_dir(model_path: str, revision: str | None = None) -> Path:
    """The local HF folder a `target.model_path` names: a folder; a `.gguf` file, locally or as
    `package://<pkg>/<file>.gguf`, converted once into a cached folder (tasks/gguf_target.py);
    a folder inside a package; or a hub id already in the local Hugging Face cache (no download)."""
    if is_package_path(model_path):
        try:
            path = resolve_package_path(model_path)
        except PackagePathError as e:
            raise TargetError(f"target.model_path: {e}") from None
    else:
        path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        try:
            return converted_dir(path, model_path)
        except GGUFTargetError as e:
            raise TargetError(f"target.model_path: {e}") from None
    if path.is_dir():
        return path
    if "://" not in model_path and looks_like_hub_id(model_path) and not path.exists():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(model_path, revision=revision, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            pass
    raise TargetError(
        f"target model not found: {model_path} (expected a local HF folder, a .gguf file, a "
        "package:// path to either, or a hub id already in the local Hugging Face cache)"
    )


def _read_chat_template(chat_template: str) -> str:
    """A template's text; a path to a .jinja file is read (SGLang's --chat-template takes both)."""
    if is_template_text(chat_template):
        return chat_template
    path = Path(chat_template).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise TargetError(f"chat_template is neither a Jinja template nor a readable file: {path}")


# The files a tokenizer is read from, once per process for the same contents (the parent flow
# and every stage flow of a run ask for it; a 200k-vocabulary tokenizer takes seconds to load).
# Keyed by their stamps as they are now, so a folder or template rewritten in place is read again.
_TOKENIZERS: dict[tuple[Any, ...], PreTrainedTokenizerBase] = {}
_TOKENIZERS_LOCK = threading.Lock()  # shard threads of one stage ask at once
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "special_tokens_map.json", "chat_template.jinja")  # fmt: skip


def _stamp(path: Path) -> tuple[str, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_mtime_ns, st.st_size)


def load_tokenizer(
    model_path: str,
    chat_template: str | None = None,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """The target's tokenizer from its local folder, with `chat_template` overriding its own.
    Read once per process for the same files; each call returns its own copy, since callers may
    set attributes on theirs (one shared object once leaked a test's edited template into the
    next tests' runs)."""
    model_dir = resolve_model_dir(model_path, revision)
    template_file = None if chat_template is None or is_template_text(chat_template) else Path(chat_template).expanduser()
    key = (str(model_dir), chat_template, trust_remote_code, *(_stamp(model_dir / n) for n in _TOKENIZER_FILES),
           _stamp(template_file) if template_file else None)  # fmt: skip
    with _TOKENIZERS_LOCK:
        return copy.deepcopy(_cached_tokenizer(key, model_path, model_dir, chat_template, trust_remote_code))


def _cached_tokenizer(
    key: tuple[Any, ...], model_path: str, model_dir: Path, chat_template: str | None, trust_remote_code: bool
) -> PreTrainedTokenizerBase:
    if key not in _TOKENIZERS:
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(model_dir), local_files_only=True, trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as e:
            raise TargetError(f"cannot load the tokenizer of {model_path}: {e}") from e
        if chat_template is not None:
            tokenizer.chat_template = _read_chat_template(chat_template)
        if not tokenizer.chat_template:
            raise TargetError(
                f"the tokenizer of {model_path} has no chat template; set target.chat_template"
            )
        _TOKENIZERS[key] = tokenizer
    return _TOKENIZERS[key]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise TargetError(
            f"messages must be a non-empty list of dicts, got {type(messages).__name__}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TargetError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TargetError(
                    f"messages[{i}].{key} must be a string, got {type(message.get(key)).__name__}"
                )


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, verbose: bool = True
) -> list[int]:
    """Token ids of `messages` rendered with the chat template and the generation prompt.

    Renders to text, then encodes without adding special tokens (the template writes its own
    bos), which is what apply_chat_template does internally; going through text keeps the
    result a plain list of ints whatever transformers' return-type conventions are.
    `verbose=False` silences the tokenizer's "longer than the specified maximum sequence
    length" warning for this call only.
    """
    _check_messages(messages)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja raises its own exception types, e.g. from raise_exception
        raise TargetError(f"chat template failed on these messages: {e}") from e
    if not isinstance(text, str):
        raise TargetError(f"chat template rendered {type(text).__name__}, expected a string")
    ids = tokenizer(text, add_special_tokens=False, verbose=verbose)["input_ids"]
    return [int(i) for i in ids]


def count_prompt_tokens(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[dict]], int]:
    """`count_tokens(messages) -> int` for discovery: the rendered prompt's length in tokens.

    Quiet: discovery measures prompts in order to filter the long ones, so the tokenizer's
    warning that a sequence exceeds the model's maximum ("will result in indexing errors") is
    noise there; everywhere else it stays on.
    """

    def count_tokens(messages: list[dict]) -> int:
        return len(render_prompt_ids(tokenizer, messages, verbose=False))

    return count_tokens


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


def read_model_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TargetError(f"{model_dir}: no config.json") from None
    except json.JSONDecodeError as e:
        raise TargetError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise TargetError(f"{path}: expected a JSON object")
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: nested for multimodal targets, else the config itself."""
    for key in _NESTED_CONFIGS:
        nested = config.get(key)
        if isinstance(nested, dict) and ("num_hidden_layers" in nested or "hidden_size" in nested):
            return nested
    return config


def context_length_of(config: dict[str, Any]) -> int | None:
    """max_position_embeddings of the model, looking into a multimodal model's text config."""
    for node in (config, *(config.get(k) for k in _NESTED_CONFIGS)):
        if isinstance(node, dict) and isinstance(node.get("max_position_embeddings"), int):
            return node["max_position_embeddings"]
    return None


def target_identity(
    model_path: str, revision: str | None, tokenizer: PreTrainedTokenizerBase
) -> dict[str, Any]:
    """The target's part of the run fingerprint."""
    model_dir = resolve_model_dir(model_path, revision)
    identity = {
        "model_path": model_path,
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
