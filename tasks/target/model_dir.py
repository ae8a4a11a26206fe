"""The target's model folder: the local HF folder a `target.model_path` names, and what its
config.json says (the language model's part of it, its context length).

Every loader of the target goes through `resolve_model_dir`: generation, extraction, training,
export and the gate all read the same folder whatever form `target.model_path` took.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.target.errors import TargetError  # imported from here by callers
from tasks.target.families.registry import language_config, nested_config_keys
from tasks.target.gguf_convert import GGUFTargetError, converted_dir
from tasks.target.multipart import MultipartError, assembled_file, is_multipart_path
from tasks.target.packages import PackagePathError, is_package_path, resolve_package_path
from tasks.target.path_kinds import looks_like_hub_id


def resolve_model_dir(model_path: str, revision: str | None = None) -> Path:
    """The local HF folder a `target.model_path` names: a folder; a `.gguf` file, locally or as
    `package://<pkg>/<file>.gguf`, converted once into a cached folder (tasks/target/gguf_convert.py);
    a folder inside a package; a GGUF assembled from package parts (`multipart://`,
    tasks/target/multipart.py), converted likewise; or a hub id already in the local Hugging Face
    cache (no download)."""
    if is_multipart_path(model_path):
        try:
            gguf, sha256 = assembled_file(model_path)
            return converted_dir(gguf, model_path, sha256=sha256)
        except (MultipartError, GGUFTargetError) as e:
            raise TargetError(f"target.model_path: {e}") from None
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
        "package:// path to either, a multipart:// GGUF, or a hub id already in the local "
        "Hugging Face cache)"
    )


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
    """The language model's config: nested for multimodal targets (where the family's module
    says, tasks/target/families/), else the config itself."""
    return language_config(config)


def context_length_of(config: dict[str, Any]) -> int | None:
    """max_position_embeddings of the model, looking into a multimodal model's text config."""
    for node in (config, *(config.get(k) for k in nested_config_keys(config.get("model_type")))):
        if isinstance(node, dict) and isinstance(node.get("max_position_embeddings"), int):
            return node["max_position_embeddings"]
    return None
