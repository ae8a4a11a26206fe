"""SGLang's `launch_server` flags as a pinned version's recorded `--help` lists them.

`extract_help_flags(text)` reads argparse's help output: every option name (aliases included),
the choices of options that have them, and the deprecated aliases with the flags their help
points to instead. The result for each version with a recorded `--help` is shipped as
`tasks/data/sglang/flags-<version>.json` (regenerate: `python -m tasks.sglang.recorded_flags
HELP.txt VERSION > tasks/data/sglang/flags-VERSION.json`; a test checks the shipped file equals the
extraction from tests/fixtures/sglang-<version>/help.txt). The launch builder checks every flag it
emits and every extra server arg against it; the emulator parses its command line with it.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from dataclasses import dataclass
from importlib import resources
from typing import Any

# An option entry in argparse's "options:" section: two spaces, then the option's names.
_ENTRY = re.compile(r"^  (-\S.*)$")
# Where the help text names another flag (a wrapped line is re-joined first).
_FLAG_REF = re.compile(r"--[a-z0-9][a-z0-9-]*(?:\{[a-z,]+\})?(?:=[a-z_]+)?")
_DEPRECATED = re.compile(r"\bdeprecated\b", re.I)


@dataclass(frozen=True)
class RecordedFlags:
    """What one SGLang version's `launch_server --help` accepts."""

    version: str
    flags: frozenset[str]  # every option name, aliases included
    choices: dict[str, tuple[str, ...]]  # option -> its allowed values, where it has a fixed set
    deprecated: dict[str, tuple[str, ...]]  # deprecated alias -> the flags its help names instead

    def replacement(self, flag: str) -> str:
        """'use X' for a deprecated alias, from what its help names (may be empty)."""
        names = self.deprecated.get(flag, ())
        return f"use {' or '.join(names)} instead" if names else "it has no replacement flag"


def _join(lines: list[str]) -> str:
    """Re-join wrapped help lines; textwrap breaks after hyphens, so a line ending in '-' is
    continued without a space (restores `--cuda-graph-backend-prefill` split over two lines)."""
    out = ""
    for piece in (line.strip() for line in lines):
        if not piece:
            continue
        out = out + piece if out.endswith("-") or not out else f"{out} {piece}"
    return out


def extract_help_flags(text: str) -> dict[str, Any]:
    """The flags, choices and deprecated aliases of an argparse `--help` text (a JSON-ready dict)."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() in ("options:", "optional arguments:"))
    except StopIteration:
        raise ValueError("no 'options:' section: not an argparse --help output") from None
    entries: list[tuple[str, list[str]]] = []  # (head, description lines)
    for line in lines[start + 1 :]:
        m = _ENTRY.match(line)
        if m:
            head, _, first = m.group(1).partition("  ")  # two spaces separate head and help
            entries.append((head.strip(), [first]))
        elif entries:
            entries[-1][1].append(line)
    flags: set[str] = set()
    choices: dict[str, list[str]] = {}
    deprecated: dict[str, list[str]] = {}
    for head, desc in entries:
        names = []
        for part in re.split(r",\s+|\s+\|\s+", head):
            name, _, rest = part.partition(" ")
            if name.startswith("-"):
                names.append(name)
                found = re.match(r"\[?\{([^}]*)\}", rest)
                if found:
                    choices[name] = found.group(1).split(",")
        if "--help" in names:
            continue
        flags.update(names)
        description = _join(desc)
        if _DEPRECATED.search(description):
            refs = [r for r in dict.fromkeys(_FLAG_REF.findall(description)) if r not in names]
            for name in names:
                deprecated[name] = refs
    return {
        "flags": sorted(flags),
        "choices": {k: choices[k] for k in sorted(choices)},
        "deprecated": {k: deprecated[k] for k in sorted(deprecated)},
    }


@functools.cache
def recorded_flags(version: str) -> RecordedFlags | None:
    """The shipped flag list of `version`, or None when no `--help` of it was recorded."""
    path = resources.files("tasks") / "data" / "sglang" / f"flags-{version}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("version") != version:
        raise ValueError(f"{path}: records version {data.get('version')!r}, expected {version!r}")
    return RecordedFlags(
        version=version,
        flags=frozenset(data["flags"]),
        choices={k: tuple(v) for k, v in data["choices"].items()},
        deprecated={k: tuple(v) for k, v in data["deprecated"].items()},
    )


def flags_document(help_text: str, version: str, source: str) -> dict[str, Any]:
    """The shipped JSON document for one version: where it came from, then the extraction."""
    return {"version": version, "source": source, **extract_help_flags(help_text)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m tasks.sglang.recorded_flags HELP.txt VERSION [SOURCE]", file=sys.stderr)
        return 2
    path, version = args[0], args[1]
    source = args[2] if len(args) == 3 else f"launch_server --help of SGLang {version}"
    with open(path) as f:
        doc = flags_document(f.read(), version, source)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
