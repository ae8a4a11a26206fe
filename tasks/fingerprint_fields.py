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
    sampling = cfg.sampling.model_dump()
    # Unset, the key stays out, so runs fingerprinted before it existed resume (and reuse_from
    # compares them alike).
    if not sampling["max_new_tokens_by_domain"]:
        sampling.pop("max_new_tokens_by_domain")
    fp: dict[str, Any] = {
        "target": target_identity,
        "sampling": sampling,
        "code_version": code_version(),
    }
    if manifest_hash is not None:
        fp["manifest_hash"] = manifest_hash
    return fp
