"""The discover stage as plain code: read sources, build the manifest, commit it once."""

from __future__ import annotations

import logging
from typing import Any

from tasks.config import EagleScaleConfig
from tasks.discover.commit import check_discovery_config, commit_discovery, discovery_marker
from tasks.runfolder import RunFolder, content_hash
from tasks.runfolder.layout import DISCOVERY_REPORT
from tasks.target.tokenizer import count_prompt_tokens

log = logging.getLogger(__name__)


def discover_config_hash(cfg: EagleScaleConfig) -> str:
    # The tokenizer decides the length filter, so the target's identity is part of it.
    return content_hash({"discover": cfg.discover.model_dump(), "target": cfg.target.model_dump()}, 16)


def run_discover_stage(cfg: EagleScaleConfig, run: RunFolder, tokenizer: Any) -> dict[str, Any]:
    """Returns the discovery report; `skipped` is True when prompts/ was already committed."""
    from tasks.discover import discover_prompts

    config_hash = discover_config_hash(cfg)
    if check_discovery_config(run, config_hash, cfg.allow_fingerprint_change):
        log.info("prompts/ already committed for this discover config; skipping discovery")
        report = run.read_json(DISCOVERY_REPORT) or {}
        return {"skipped": True, "report": report, "marker": discovery_marker(run)}
    options = None if run.is_local else cfg.storage_options
    result = discover_prompts(cfg.discover, count_prompt_tokens(tokenizer), options)
    marker = commit_discovery(run, result.tables(), result.report, result.report_markdown(), config_hash)
    return {"skipped": False, "report": result.report, "report_md": result.report_markdown(), "marker": marker}
