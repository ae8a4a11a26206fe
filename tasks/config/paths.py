"""Which configuration keys name local paths (PATH_KEYS), and how each is made absolute.

Paths never depend on where a command starts: relative paths in a params file resolve against
the params file's folder, those given with `--set`/`--run-root` against the working directory,
and those that reach the model directly (a deployment's parameters, the Prefect UI form, Python)
against the working directory of the process that validates them (for a deployment, the checkout
its pull step moves to). URLs (`s3://`, `package://`, any `scheme://`) and absolute paths are kept
as written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tasks.target.path_kinds import is_template_text, looks_like_hub_id

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Validation context key: load_config has resolved the paths (EagleScaleConfig leaves them alone).
PATHS_RESOLVED = "eaglescale_paths_resolved"


@dataclass(frozen=True)
class PathKey:
    key: str  # dotted; `name[]` walks the items of a list
    # input: must exist before the run; output: a stage makes it; optional: resolved, and a
    # missing one is the stage's to report (a challenger that is not there is left out, not fatal)
    role: Literal["input", "output", "optional"]
    what: str  # for messages


# Every config key that names a local file or folder: the one list path resolution, the
# pre-run existence check and deployments/sync_profiles.py's rebasing read.
PATH_KEYS: tuple[PathKey, ...] = (
    PathKey("run_root", "output", "run folder"),
    PathKey("target.model_path", "input", "model folder or .gguf file"),
    PathKey("target.chat_template", "input", "chat template file"),
    PathKey("discover.sources[].path", "input", "source file, glob or folder"),
    PathKey("discover.holdout_from", "input", "run folder or holdout parquet file"),
    PathKey("generate.reuse_from", "input", "earlier run folder"),
    PathKey("train.init_from", "input", "exported draft folder"),
    PathKey("gate.registry_url", "output", "registry folder"),
    PathKey("gate.python", "input", "Python interpreter"),
    PathKey("gate.challengers[].path", "optional", "challenger draft folder"),
)


def is_url(value: str) -> bool:
    """`s3://...`, `package://...`, any `scheme://`: never rebased."""
    return bool(_SCHEME.match(value))


@dataclass(frozen=True)
class PathOrigin:
    """One path value as resolved: where it was written and what it was relative to."""

    key: str  # concrete key, e.g. discover.sources[1].path
    role: Literal["input", "output", "optional"]
    what: str
    value: str  # as resolved (absolute)
    given: str  # as written
    base: Path | None  # the folder a relative value was joined to (None: absolute as written)
    base_name: str  # e.g. "the folder of the params file x.yaml", "the working directory"
    hub_id: bool = False  # target.model_path kept as a hub id: no such folder under base


def path_slots(data: Any, key: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(concrete key, the mapping that holds it, its name there) for each place `key` names."""
    parts = key.split(".")

    def walk(node: Any, i: int, prefix: str) -> Iterator[tuple[str, dict[str, Any], str]]:
        name = parts[i].removesuffix("[]")
        if not isinstance(node, dict) or name not in node:
            return
        here = f"{prefix}{name}"
        if i == len(parts) - 1:
            yield here, node, name
        elif parts[i].endswith("[]"):
            for j, item in enumerate(node[name] if isinstance(node[name], list) else []):
                yield from walk(item, i + 1, f"{here}[{j}].")
        else:
            yield from walk(node[name], i + 1, f"{here}.")

    yield from walk(data, 0, "")


def _is_local_path(spec: PathKey, value: str) -> bool:
    """Whether `value` of this key names a local path (else it is kept exactly as written)."""
    if not value or is_url(value):
        return False
    if spec.key == "target.chat_template" and is_template_text(value):
        return False
    # A bare command name is looked up on PATH.
    return not (spec.key == "gate.python" and "/" not in value)


def _is_hub_id(spec: PathKey, value: str, base: Path) -> bool:
    """`org/name` as target.model_path is a hub id unless such a folder exists under base."""
    return spec.key == "target.model_path" and looks_like_hub_id(value) and not (base / value).exists()


def resolve_paths(
    data: dict[str, Any], base_of: Callable[[str], tuple[Path, str]]
) -> list[PathOrigin]:
    """Make every relative local path in `data` (raw config, changed in place) absolute.

    `base_of(concrete key)` gives the folder a relative value of that key is relative to, and
    how to name it in messages. Returns where each local path value came from.
    """
    origins = []
    for spec in PATH_KEYS:
        for key, node, name in list(path_slots(data, spec.key)):
            given = node[name]
            if not isinstance(given, str):
                continue  # pydantic names the wrong type
            base, base_name = base_of(key)
            if not _is_local_path(spec, given):
                continue
            if _is_hub_id(spec, given, base):
                origins.append(PathOrigin(key, spec.role, spec.what, given, given, base, base_name, True))
                continue
            expanded = os.path.expanduser(given)
            if os.path.isabs(expanded):
                origins.append(PathOrigin(key, spec.role, spec.what, expanded, given, None, base_name))
                continue
            value = os.path.normpath(base / expanded)
            node[name] = value
            origins.append(PathOrigin(key, spec.role, spec.what, value, given, base, base_name))
    return origins
