"""Loading the configuration: a params YAML, `--set` overrides and a run root, validated into
an `EagleScaleConfig` whose paths are absolute (tasks/config/paths.py says against what)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tasks.config.paths import PATHS_RESOLVED, resolve_paths
from tasks.config.sections import EagleScaleConfig
from tasks.errors import ExpectedFailure


class ConfigError(ValueError, ExpectedFailure):
    """A params file or override that does not fit the model; the message names key and file."""


def _format_errors(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key '{key}'")
        elif not key:
            # A whole-config rule (contradictions): its message names the keys; the input would
            # be the entire config.
            message = e["msg"].removeprefix("Value error, ")
            lines += [f"{where}: {line}" for line in message.splitlines()]
        else:
            lines.append(f"{where}: key '{key}': {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


_INDEXED = re.compile(r"^([^\[\]]+)((?:\[\d+\])*)$")  # name, then list indices: sources[0]


def _part_covers(override: str, key: str) -> bool:
    """`sources` covers every item of the list (`sources[0]`, ...); `sources[0]` only its own."""
    return override == key or override == re.sub(r"\[\d+\]", "", key)


def _covers(override: list[str], key: str) -> bool:
    """Whether an override of the dotted path `override` set (part of) the value at `key`."""
    parts = key.split(".")
    n = min(len(parts), len(override))
    return all(_part_covers(o, k) for o, k in zip(override[:n], parts[:n], strict=True))


_YAML_NULLS = ("null", "Null", "NULL", "~")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value); the value is parsed as YAML (1, true, [x]).

    Except where YAML would drop what was typed: `#` starts a YAML comment, so `#ops` reads as
    null and `ops #1` as `ops`. A value YAML reads as null (unless it is spelled null or ~),
    or as a string that a `#` cut short, is the text itself, stripped: `slack.channel=#ops`
    is the channel `#ops`. `key=` is the empty string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set {text!r}: empty key")
    if not raw:
        return key.strip().split("."), ""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({e})") from None
    literal = raw.strip()
    read_as_nothing = value is None and literal not in _YAML_NULLS
    cut_at_hash = isinstance(value, str) and "#" in literal and "#" not in value
    return key.strip().split("."), literal if read_as_nothing or cut_at_hash else value


def _item(holder: dict[str, Any] | list[Any], key: str | int) -> Any:
    """holder[key] for a section's key (None when absent) or a list's index."""
    return holder.get(key) if isinstance(holder, dict) else holder[key]  # type: ignore[arg-type]


def _step(node: dict[str, Any], part: str, text: str, where: str) -> tuple[Any, str | int]:
    """The container in section `node` (at `where`) that holds `part` (a key, or a key with
    list indices) and its last key."""
    m = _INDEXED.match(part)
    if m is None:
        raise ConfigError(f"--set {text!r}: '{part}' is not a key or key[index]")
    name, indices = m.group(1), [int(i) for i in re.findall(r"\d+", m.group(2))]
    holder: Any = node
    last: str | int = name
    path = f"{where}.{name}".lstrip(".")
    for index in indices:
        items = _item(holder, last)
        if not isinstance(items, list):
            raise ConfigError(f"--set {text!r}: '{path}' is not a list")
        if index >= len(items):
            raise ConfigError(
                f"--set {text!r}: '{path}' has {len(items)} item(s); index {index} is past its end"
            )
        holder, last, path = items, index, f"{path}[{index}]"
    return holder, last


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Each `key.path=value` set in `data`; a part may index a list (`sources[0].domain=x`)
    that the params already hold. Missing sections are created, missing list items are not."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        where = ""
        for part in path[:-1]:
            holder, last = _step(node, part, text, where)
            nxt = _item(holder, last)
            if nxt is None and isinstance(holder, dict):
                nxt = holder[last] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {text!r}: '{part}' is not a section")
            node, where = nxt, f"{where}.{part}".lstrip(".")
        holder, last = _step(node, path[-1], text, where)
        holder[last] = value
    return data


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    run_root: str | None = None,
) -> EagleScaleConfig:
    """Load a params YAML, apply `--set` overrides and an optional run root, validate.

    Relative paths (PATH_KEYS) from the file resolve against the file's folder; those from an
    override or `run_root` against the working directory. The result holds absolute paths,
    so it means the same from any working directory, and `path_origins()` says how each
    was resolved (check_input_paths names both in its messages).
    """
    data: dict[str, Any] = {}
    where = "<overrides>"
    cwd = Path.cwd()
    file_base = cwd
    if path is not None:
        where = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{where}: params file not found ({os.path.abspath(path)})") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        data = loaded
        file_base = Path(os.path.abspath(path)).parent
    set_keys = [parse_override(text)[0] for text in overrides or []]
    if overrides:
        data = apply_overrides(data, overrides)
        where = f"{where} (with --set {' '.join(overrides)})"
    if run_root is not None:
        data["run_root"] = run_root
        set_keys.append(["run_root"])

    def base_of(key: str) -> tuple[Path, str]:
        if any(_covers(keys, key) for keys in set_keys):
            return cwd, "the working directory (a --set or --run-root value)"
        if path is None:
            return cwd, "the working directory"
        return file_base, f"the folder of the params file {path}"

    origins = resolve_paths(data, base_of)
    try:
        config = EagleScaleConfig.model_validate(data, context={PATHS_RESOLVED: True})
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where)) from None
    config._path_origins = origins
    return config
