"""The check before anything starts: every input path the stages of this process will read
exists (the model folder, the chat template file, the sources and an earlier run's holdout, the
earlier run whose generation is reused, the draft training starts from, the gate's interpreter),
named in its absolute form and with what it was relative to."""

from __future__ import annotations

import glob
import json
import os

from tasks.config.loading import ConfigError
from tasks.config.paths import PATH_KEYS, PathOrigin, path_slots
from tasks.config.sections import EagleScaleConfig
from tasks.target.multipart import is_multipart_path, parts_problem
from tasks.target.packages import PackagePathError, resolve_package_path

_GLOB_CHARS = "*?["


def _describe(origin: PathOrigin) -> str:
    if origin.base is None:
        return f"{origin.given!r} as written"
    return f"{origin.given!r} relative to {origin.base_name}, {origin.base}"


def _input_problem(origin: PathOrigin, config: EagleScaleConfig) -> str | None:
    """Why an input path cannot be used, or None."""
    value = origin.value
    if origin.hub_id:
        # Only here is the model-folder resolver imported (with it the GGUF converter and numpy):
        # a hub id is rare next to a folder.
        from tasks.target.model_dir import TargetError, resolve_model_dir

        try:
            resolve_model_dir(value)
        except TargetError:
            return (
                f"no {origin.what} at {origin.base / value if origin.base else value}, and "
                f"{value!r} is no hub id in the local Hugging Face cache either"
            )
        return None
    if origin.key == "target.model_path":  # a folder, or a GGUF file (converted on first load)
        if os.path.isdir(value) or (os.path.isfile(value) and value.endswith(".gguf")):
            return None
        return f"no {origin.what} at {value}"
    if origin.key.startswith("discover.sources"):
        if any(ch in value for ch in _GLOB_CHARS):
            return None if glob.glob(value) else f"no file matches {value}"
        if os.path.isfile(value) and os.path.getsize(value) == 0:
            # Its domain would vanish from the mixture, and only the report would say so.
            return f"{value} is empty (0 bytes): fill it, or remove the source"
        return None if os.path.exists(value) else f"no file or folder at {value}"
    if origin.key == "discover.holdout_from":  # a run root (a folder) or the parquet file itself
        return None if os.path.exists(value) else f"no {origin.what} at {value}"
    if origin.key == "generate.reuse_from":  # a run root: generation reads its committed shards
        if os.path.isdir(value):
            return None
        if os.path.exists(value):
            return f"{value} is a file, not a run folder"
        return f"no {origin.what} at {value}"
    if origin.key == "train.init_from":
        return _starting_draft_problem(value, config)
    if os.path.isfile(value):
        return None
    return f"no {origin.what} at {value}"


def _starting_draft_problem(value: str, config: EagleScaleConfig) -> str | None:
    """Before the run: an exported draft is there, made for this run's draft vocabulary size (the
    train stage checks the rest against the target when it starts, before reading any data)."""
    if not os.path.isdir(value):
        return f"no exported draft folder at {value}"
    missing = [name for name in ("config.json", "model.safetensors") if not os.path.isfile(os.path.join(value, name))]
    if missing:
        return f"{value} holds no exported draft (no {' or '.join(missing)})"
    try:
        with open(os.path.join(value, "config.json")) as f:
            draft = json.load(f)
    except (OSError, ValueError) as err:
        return f"{value}/config.json is not readable JSON ({err})"
    size = draft.get("draft_vocab_size")  # both export formats keep it at the top
    if size is not None and int(size) != config.train.draft_vocab_size:
        return (f"the draft at {value} has a draft vocabulary of {size} tokens, this run's "
                f"train.draft_vocab_size is {config.train.draft_vocab_size}")
    return None


def _needs_locally(config: EagleScaleConfig, key: str) -> bool:
    """Whether the stages this process runs read the input at `key` (others run elsewhere)."""
    if key.startswith("discover."):
        return "discover" in config.stages
    if key.startswith("generate."):  # read by the generate stage, wherever it runs
        deployed = "generate" in config.orchestration.stage_deployments
        return "generate" in config.stages and not deployed
    if key.startswith("train."):  # read by the train stage, wherever it runs
        return "train" in config.stages and "train" not in config.orchestration.stage_deployments
    if key.startswith("gate."):
        gate_here = "gate" in config.stages and "gate" not in config.orchestration.stage_deployments
        # The interpreter launches SGLang servers (the only gate input checked before the run).
        return gate_here and (key != "gate.python" or config.gate.engine == "sglang")
    return True  # the target: the parent reads its tokenizer for the fingerprint, every stage uses it


def check_input_paths(config: EagleScaleConfig) -> None:
    """Refuse, before anything starts, input paths this process needs that do not exist.

    Names each missing path in its absolute form and what it was relative to. Paths the
    stages create (run_root, the registry) need not exist; URLs are left to the stage that
    opens them, except `package://` paths, which are looked up here (cheaply, no import), and
    a `multipart://` target, whose parts are (each installed and of its size, unless the file
    is assembled already).
    """
    problems = []
    for origin in config.path_origins():
        if origin.role != "input" or not _needs_locally(config, origin.key):
            continue
        problem = _input_problem(origin, config)
        if problem is not None:
            problems.append(f"{origin.key}: {problem} ({_describe(origin)})")
    for spec in (s for s in PATH_KEYS if s.role == "input"):
        for key, node, name in path_slots(config.model_dump(), spec.key):
            value = node[name]
            if isinstance(value, str) and value.startswith("package://") and _needs_locally(config, key):
                try:
                    resolve_package_path(value)
                except PackagePathError as e:
                    problems.append(f"{key}: {e}")
            elif isinstance(value, str) and is_multipart_path(value) and _needs_locally(config, key):
                problem = parts_problem(value)
                if problem is not None:
                    problems.append(f"{key}: {problem}")
    if problems:
        raise ConfigError("missing input paths:\n  - " + "\n  - ".join(problems))
