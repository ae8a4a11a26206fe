"""Copy deployments/params/<profile>.yaml into deployments/prefect.yaml's parameter blocks.

prefect.yaml cannot include another file, so each deployment's `parameters.config` is a copy
of a profile between `# <profile: NAME>` and `# </profile>` lines. Run this after editing a
profile (`--check` exits 1 when a copy is stale; tests/test_deployments.py checks the same).

Relative paths mean different things in the two places. In a params file they are relative to
the file's folder (deployments/params/); in a deployment's parameters they are relative to the
flow run's working directory, which every pull step in prefect.yaml sets to the checkout root.
So the copy rebases each relative path (the keys of tasks.config.PATH_KEYS) from the params
folder to the checkout root (`../../.eaglescale/tiny-target` -> `.eaglescale/tiny-target`) and
keeps the rest of the text, comments included. The rebased copy is parsed back and must mean
exactly what the profile means, or nothing is written.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from tasks.config import resolve_paths
from tasks.target.path_kinds import looks_like_hub_id

HERE = Path(__file__).resolve().parent
# Where a deployment's flow run works: the pull steps' folder (the checkout root).
CHECKOUT = HERE.parent
BLOCK = re.compile(r"^(?P<indent> *)# <profile: (?P<name>[\w-]+)>\n.*?^(?P=indent)# </profile>\n", re.M | re.S)


class RebaseError(ValueError):
    """A profile whose relative paths cannot be rewritten for the deployments' working directory."""


def _resolved(data: dict[str, Any], base: Path) -> dict[str, Any]:
    data = copy.deepcopy(data)
    resolve_paths(data, lambda key: (base, str(base)))
    return data


def rebase_profile(text: str, name: str, params_dir: Path, checkout: Path = CHECKOUT) -> str:
    """The profile's text with its relative paths made relative to `checkout`, not `params_dir`."""
    data = yaml.safe_load(text)
    origins = resolve_paths(copy.deepcopy(data), lambda key: (params_dir, str(params_dir)))
    rebased = text
    for origin in {(o.key, o.given, o.value) for o in origins if o.base is not None and not o.hub_id}:
        key, given, value = origin
        field = key.rsplit(".", 1)[-1]
        new = os.path.relpath(value, checkout)
        if key == "target.model_path" and looks_like_hub_id(new):
            new = f"./{new}"  # `models/m` alone would read as a hub id
        # `field: value` in block or flow style, optionally quoted, up to a comma, brace or comment.
        pattern = re.compile(
            rf"(?<![\w-])({re.escape(field)}:[ \t]*)(['\"]?){re.escape(given)}\2(?=[ \t]*(?:[,}}#\n]|$))",
            re.M,
        )
        rebased, count = pattern.subn(lambda m, new=new: f"{m[1]}{m[2]}{new}{m[2]}", rebased)
        if not count:
            raise RebaseError(f"profile {name}: cannot find {key}: {given} in the text to rebase it")
    # The copy must mean what the profile means: the same config once each is resolved
    # against its own base.
    if _resolved(yaml.safe_load(rebased), checkout) != _resolved(data, params_dir):
        raise RebaseError(
            f"profile {name}: the rebased copy does not resolve to the profile's paths; write "
            "the paths it names as absolute or package:// paths"
        )
    return rebased


def render(text: str, params_dir: Path = HERE / "params", checkout: Path = CHECKOUT) -> str:
    def block(m: re.Match[str]) -> str:
        indent, name = m["indent"], m["name"]
        profile = rebase_profile((params_dir / f"{name}.yaml").read_text(), name, params_dir, checkout)
        body = "".join(f"{indent}{line}" if line.strip() else "\n" for line in profile.splitlines(keepends=True))
        return f"{indent}# <profile: {name}>\n{body}{indent}# </profile>\n"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if prefect.yaml is out of date")
    parser.add_argument("--prefect-file", type=Path, default=HERE / "prefect.yaml")
    args = parser.parse_args(argv)
    text = args.prefect_file.read_text()
    try:
        rendered = render(text)
    except RebaseError as e:
        print(f"{args.prefect_file}: {e}", file=sys.stderr)
        return 1
    if args.check:
        if rendered != text:
            print(f"{args.prefect_file}: a profile copy is stale; run python deployments/sync_profiles.py", file=sys.stderr)
            return 1
        return 0
    args.prefect_file.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
