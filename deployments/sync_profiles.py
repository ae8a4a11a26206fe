"""Copy deployments/params/<profile>.yaml into deployments/prefect.yaml's parameter blocks.

prefect.yaml cannot include another file, so each deployment's `parameters.config` is a copy
of a profile between `# <profile: NAME>` and `# </profile>` lines. Run this after editing a
profile (`--check` exits 1 when a copy is stale; tests/test_deployments.py checks the same).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = re.compile(r"^(?P<indent> *)# <profile: (?P<name>[\w-]+)>\n.*?^(?P=indent)# </profile>\n", re.M | re.S)


def render(text: str, params_dir: Path = HERE / "params") -> str:
    def block(m: re.Match[str]) -> str:
        indent, name = m["indent"], m["name"]
        profile = (params_dir / f"{name}.yaml").read_text()
        body = "".join(f"{indent}{line}" if line.strip() else "\n" for line in profile.splitlines(keepends=True))
        return f"{indent}# <profile: {name}>\n{body}{indent}# </profile>\n"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if prefect.yaml is out of date")
    parser.add_argument("--prefect-file", type=Path, default=HERE / "prefect.yaml")
    args = parser.parse_args(argv)
    text = args.prefect_file.read_text()
    rendered = render(text)
    if args.check:
        if rendered != text:
            print(f"{args.prefect_file}: a profile copy is stale; run python deployments/sync_profiles.py", file=sys.stderr)
            return 1
        return 0
    args.prefect_file.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
