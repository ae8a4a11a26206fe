"""The target's token embedding and output head, read alone from its safetensors files.

The draft shares the target's embedding and its teacher needs the target's lm_head; nothing
else of a terabyte-sized target is read (safe_open reads the named tensors only). Sharded
checkpoints are found through their `*.safetensors.index.json`; a target with tied
embeddings uses its embedding as the head. The final norm's weight is read the same way when
the draft's norm starts from it (train.init_norm_from_target). Which tensor names to look for,
and whether the norm means what the draft's does, the target's family module says
(tasks/target/families/).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tasks.errors import ExpectedFailure
from tasks.target.families.base import TargetFamily
from tasks.target.families.registry import config_model_type, family_for
from tasks.target.model_dir import read_model_config, resolve_model_dir, text_config


class TargetHeadsError(ValueError, ExpectedFailure):
    """The target's embedding or lm_head cannot be found or does not fit its config."""


def _weight_map(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it."""
    indexes = sorted(model_dir.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise TargetHeadsError(f"{model_dir}: several safetensors indexes: {[p.name for p in indexes]}")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise TargetHeadsError(f"{indexes[0]}: not a safetensors index ({e})") from None
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TargetHeadsError(f"{model_dir}: no *.safetensors weights (other formats are not read)")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def _family(config: dict[str, Any]) -> TargetFamily:
    return family_for(config_model_type(config), "the target's embedding, head and norm")


def _pick(weight_map: dict[str, Path], known: tuple[str, ...], suffix: str) -> str | None:
    for key in known:
        if key in weight_map:
            return key
    matches = [k for k in weight_map if k.endswith(suffix) and "vision" not in k]
    if len(matches) > 1:
        raise TargetHeadsError(f"several tensors could be the {suffix}: {sorted(matches)}")
    return matches[0] if matches else None


def _read(weight_map: dict[str, Path], key: str) -> torch.Tensor:
    with safe_open(str(weight_map[key]), framework="pt") as f:
        return f.get_tensor(key)


def load_target_heads(model_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_weight [vocab, H], lm_head_weight [vocab, H]) in the checkpoint's dtype."""
    model_dir = resolve_model_dir(model_path)
    raw = read_model_config(model_dir)
    family, config = _family(raw), text_config(raw)
    weight_map = _weight_map(model_dir)
    embed_key = _pick(weight_map, family.embed_keys, "embed_tokens.weight")
    if embed_key is None:
        raise TargetHeadsError(f"{model_path}: no token embedding among its tensors")
    embed = _read(weight_map, embed_key)
    head_key = _pick(weight_map, family.head_keys, "lm_head.weight")
    if head_key is not None:
        head = _read(weight_map, head_key)
    elif config.get("tie_word_embeddings") or raw.get("tie_word_embeddings"):
        head = embed
    else:
        raise TargetHeadsError(
            f"{model_path}: no lm_head.weight and tie_word_embeddings is not set"
        )
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    for name, tensor in (("embedding", embed), ("lm_head", head)):
        if tensor.dim() != 2 or tensor.shape[1] != hidden:
            raise TargetHeadsError(
                f"{model_path}: {name} is {list(tensor.shape)}, expected [vocab, {hidden}]"
            )
        if vocab is not None and tensor.shape[0] != vocab:
            raise TargetHeadsError(
                f"{model_path}: {name} has {tensor.shape[0]} rows, config vocab_size is {vocab}"
            )
    return embed, head


def load_target_norm(model_path: str) -> torch.Tensor:
    """The target's final norm weight [hidden] (applied before its lm_head), checkpoint dtype."""
    model_dir = resolve_model_dir(model_path)
    raw = read_model_config(model_dir)
    family, config = _family(raw), text_config(raw)
    if family.norm_plus_one:  # its stored weight is not the draft's RMSNorm weight
        raise TargetHeadsError(
            f"{model_path}: a {config_model_type(raw)} target's norm scales by 1 + weight, the draft's RMSNorm by "
            "its weight; train.init_norm_from_target does not convert it"
        )
    weight_map = _weight_map(model_dir)
    key = _pick(weight_map, family.norm_keys, "model.norm.weight")
    if key is None:
        raise TargetHeadsError(f"{model_path}: no final norm weight (model.norm.weight) among its tensors")
    norm = _read(weight_map, key)
    hidden = config.get("hidden_size")
    if norm.dim() != 1 or norm.shape[0] != hidden:
        raise TargetHeadsError(f"{model_path}: {key} is {list(norm.shape)}, expected [{hidden}]")
    return norm
