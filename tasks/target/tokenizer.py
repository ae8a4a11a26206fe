"""The target's tokenizer and prompt rendering.

The generate stage renders prompts to token ids here (engines only ever see ids), and discovery
counts prompt tokens here.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tasks.target.families.registry import find_family
from tasks.target.model_dir import TargetError, resolve_model_dir
from tasks.target.path_kinds import is_template_text


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


def _family_kwargs(model_dir: Path) -> dict[str, Any]:
    """What the target's family module says AutoTokenizer needs (its `tokenizer_kwargs`):
    transformers 5 warns that a tokenizer of over 100k tokens from a folder whose config.json
    names no `transformers_version` (a GGUF conversion writes none, so its bytes do not depend on
    the version) may carry Mistral's broken regex, and that "this will lead to incorrect
    tokenization". For the families eaglescale knows that is false (Qwen2.5-Coder's converted
    tokenizer gives transformers' own GGUF tokenizer's ids, BENCHMARKS P10), so
    they decline the fix, and the false warning with it. A model_type no family knows loads as
    transformers loads it: the tokenizer serves generation of any target."""
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return {}
    family = find_family(model_type) if isinstance(model_type, str) else None
    return dict(family.tokenizer_kwargs) if family else {}


def _cached_tokenizer(
    key: tuple[Any, ...], model_path: str, model_dir: Path, chat_template: str | None, trust_remote_code: bool
) -> PreTrainedTokenizerBase:
    if key not in _TOKENIZERS:
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(model_dir), local_files_only=True, trust_remote_code=trust_remote_code,
                **_family_kwargs(model_dir),
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
    ids = tokenizer(render_prompt_text(tokenizer, messages), add_special_tokens=False, verbose=verbose)["input_ids"]
    return [int(i) for i in ids]


def render_prompt_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    """`messages` rendered with the chat template and the generation prompt, as text;
    TargetError when they or the template cannot be."""
    _check_messages(messages)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja raises its own exception types, e.g. from raise_exception
        raise TargetError(f"chat template failed on these messages: {e}") from e
    if not isinstance(text, str):
        raise TargetError(f"chat template rendered {type(text).__name__}, expected a string")
    return text


def render_many_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, many: list[list[dict]]
) -> list[list[int] | TargetError]:
    """render_prompt_ids of each of `many`, the texts encoded in one call: a fast tokenizer
    encodes a batch on all cores, where one call per prompt spent 41 s of a 2-core box on run
    21's 39,666 prompts (the ids are the same). A prompt that cannot be rendered gets its
    TargetError in its place, so that the caller can drop that one alone."""
    texts: list[str] = []
    errors: dict[int, TargetError] = {}
    for i, messages in enumerate(many):
        try:
            texts.append(render_prompt_text(tokenizer, messages))
        except TargetError as e:
            errors[i] = e
    encoded = iter(tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else [])
    return [errors[i] if i in errors else [int(t) for t in next(encoded)] for i in range(len(many))]


def count_prompt_tokens(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[dict]], int]:
    """`count_tokens(messages) -> int` for discovery: the rendered prompt's length in tokens.

    Quiet: discovery measures prompts in order to filter the long ones, so the tokenizer's
    warning that a sequence exceeds the model's maximum ("will result in indexing errors") is
    noise there; everywhere else it stays on.
    """

    def count_tokens(messages: list[dict]) -> int:
        return len(render_prompt_ids(tokenizer, messages, verbose=False))

    return count_tokens
