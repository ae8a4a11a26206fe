"""What goes into a run's fingerprint (run.json): everything that changes the generated data."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from tasks.config import EagleScaleConfig


def code_version() -> str:
    try:
        return version("eaglescale")
    except PackageNotFoundError:
        return "unknown"


def run_fingerprint(
    cfg: EagleScaleConfig, target_identity: dict[str, Any], manifest_hash: str | None
) -> dict[str, Any]:
    """Target (weights, tokenizer, chat template), sampling, prompt set and code version.

    The engine is left out on purpose: the same run may move from the local engine to SGLang
    servers, and every row records which engine produced it.
    """
    fp: dict[str, Any] = {
        "target": target_identity,
        "sampling": cfg.sampling.model_dump(),
        "code_version": code_version(),
    }
    if manifest_hash is not None:
        fp["manifest_hash"] = manifest_hash
    return fp
