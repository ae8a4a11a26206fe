"""The discover stage as plain code: read sources, build the manifest, commit it once."""

from __future__ import annotations

import logging
from typing import Any

from tasks.config import EagleScaleConfig
from tasks.discover.commit import check_discovery_config, commit_discovery, discovery_marker
from tasks.discover.holdout_from import PinnedHoldout, load_pinned_holdout
from tasks.runfolder import RunFolder, content_hash
from tasks.runfolder.layout import DISCOVERY_REPORT
from tasks.target.tokenizer import count_prompt_tokens

log = logging.getLogger(__name__)


def discover_config_hash(cfg: EagleScaleConfig, pinned: PinnedHoldout | None) -> str:
    # The tokenizer decides the length filter, so the target's identity is part of it.
    discover = cfg.discover.model_dump()
    # The held-out set itself, not its path: the earlier run may move (a later session unpacks
    # it elsewhere) and mean the same prompts, or be rediscovered in place and mean others.
    # Unset, the key stays out, so runs committed before it existed keep their hash.
    discover.pop("holdout_from")
    if not discover["max_prompt_tokens_by_domain"]:  # likewise: unset, out (runs of before keep theirs)
        discover.pop("max_prompt_tokens_by_domain")
    if pinned is not None:
        discover["holdout_from_ids"] = pinned.ids_hash()
    return content_hash({"discover": discover, "target": cfg.target.model_dump()}, 16)


def run_discover_stage(cfg: EagleScaleConfig, run: RunFolder, tokenizer: Any) -> dict[str, Any]:
    """Returns the discovery report; `skipped` is True when prompts/ was already committed."""
    from tasks.discover import discover_prompts

    options = None if run.is_local else cfg.storage_options
    # Read first: its content is part of the config hash, and a bad one fails before any work.
    pinned = load_pinned_holdout(cfg.discover, options)
    config_hash = discover_config_hash(cfg, pinned)
    if check_discovery_config(run, config_hash, cfg.allow_fingerprint_change):
        log.info("prompts/ already committed for this discover config; skipping discovery")
        report = run.read_json(DISCOVERY_REPORT) or {}
        return {"skipped": True, "report": report, "marker": discovery_marker(run)}
    result = discover_prompts(cfg.discover, count_prompt_tokens(tokenizer), options, pinned)
    marker = commit_discovery(
        run, result.tables(), result.report, result.report_markdown(), config_hash
    )
    return {
        "skipped": False,
        "report": result.report,
        "report_md": result.report_markdown(),
        "marker": marker,
    }
