"""The target families, keyed by config.json's `model_type` (docs/TARGETS.md).

Each module named in FAMILY_MODULES (under tasks/target/families/) exports `FAMILIES`, a tuple
of `TargetFamily`; they are read once per process, on first use. The rest of eaglescale asks
here: `family_for` (an unknown model_type is a TargetError naming the known ones and the doc
page that says how to add one), `find_family` where any target must still work (the tokenizer,
a config's shape), `gguf_family` and `gguf_pre_tokenizers` for the GGUF converter.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from tasks.target.errors import TargetError
from tasks.target.families.base import PreTokenizer, TargetFamily

# Adding a family: a module here, and its name in this list (docs/TARGETS.md); a dotted name is
# imported as written (a family module kept outside eaglescale).
FAMILY_MODULES = ("llama", "qwen2", "qwen3", "deepseek", "deepseek_v4", "gemma")
HOW_TO_ADD = "docs/TARGETS.md"
# Where a multimodal config of a model_type no family knows keeps its language model's config:
# generation, export-data and the fingerprint read any target's shape; what needs the family's
# knowledge refuses it later, by name.
UNREGISTERED_NESTED_KEYS = ("text_config", "language_config", "llm_config")


class UnknownTargetFamily(TargetError):
    """A model_type no family module describes."""


@functools.cache
def _index(modules: tuple[str, ...]) -> dict[str, TargetFamily]:
    """model_type -> family, over `modules` (cached per tuple, so a test that extends the list
    gets a fresh index and the original's comes back after)."""
    index: dict[str, TargetFamily] = {}
    for name in modules:
        module = importlib.import_module(name if "." in name else f"{__package__}.{name}")
        for family in module.FAMILIES:
            if family.gguf and not family.architectures:  # the converted config.json names one
                raise RuntimeError(f"{module.__name__}: {family.model_type} has a GGUF spec and no architectures")
            for model_type in family.model_types:
                if model_type in index:  # two modules claiming one model_type: a code error
                    raise RuntimeError(f"{module.__name__}: model_type {model_type!r} is registered twice")
                index[model_type] = family
    return index


def known_model_types() -> list[str]:
    return sorted(_index(FAMILY_MODULES))


def find_family(model_type: str | None) -> TargetFamily | None:
    """The family of `model_type`, or None where any target must still work."""
    return _index(FAMILY_MODULES).get(model_type) if model_type else None


def family_for(model_type: str | None, needed_for: str = "") -> TargetFamily:
    """The family of `model_type`; an UnknownTargetFamily naming the known ones otherwise.
    `needed_for`: what asked (the message says it, e.g. "the local engine's static forward")."""
    family = find_family(model_type)
    if family is None:
        what = f" ({needed_for})" if needed_for else ""
        raise UnknownTargetFamily(
            f"model_type {model_type!r}{what}: no target family describes it (known: "
            f"{', '.join(known_model_types())}); {HOW_TO_ADD} says how to add one"
        )
    return family


def config_model_type(config: dict[str, Any]) -> str:
    """The language model's model_type: a multimodal wrapper's text config's, else the config's."""
    return str(language_config(config).get("model_type") or config.get("model_type") or "")


def nested_config_keys(model_type: str | None) -> tuple[str, ...]:
    """Where a config of `model_type` may keep its language model's config."""
    family = find_family(model_type)
    if family is None:
        return UNREGISTERED_NESTED_KEYS
    return (family.text_config_key,) if family.text_config_key else ()


def language_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: nested for multimodal targets, else the config itself."""
    for key in nested_config_keys(config.get("model_type")):
        nested = config.get(key)
        if isinstance(nested, dict) and ("num_hidden_layers" in nested or "hidden_size" in nested):
            return nested
    return config


def _distinct() -> list[TargetFamily]:
    """Each family once (aliases share one), in registration order; by identity, since a
    family holds dicts and so has no hash."""
    return list({id(f): f for f in _index(FAMILY_MODULES).values()}.values())


def gguf_family(architecture: str) -> TargetFamily | None:
    """The family whose GGUF files name `architecture` (general.architecture), if any."""
    found = [f for f in _distinct() if f.gguf and f.gguf.architecture == architecture]
    return found[0] if found else None


def gguf_architectures() -> list[str]:
    return sorted(f.gguf.architecture for f in _distinct() if f.gguf)


def gguf_pre_tokenizers() -> dict[str, PreTokenizer]:
    """llama.cpp's pre-tokenizer names the families bring, by name (a GGUF of any family may
    name any of them: Qwen3's files name Qwen2's)."""
    out: dict[str, PreTokenizer] = {}
    for family in _distinct():
        if family.gguf:
            out.update(family.gguf.pre_tokenizers)
    return out
