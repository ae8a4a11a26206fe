"""The discover stage as plain code: read sources, build the manifest, commit it once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tasks.config import DiscoverConfig, EagleScaleConfig
from tasks.config.sections import SYNTHESIS_KEYS
from tasks.discover.commit import check_discovery_config, commit_discovery, discovery_marker
from tasks.discover.holdout_from import PinnedHoldout, load_pinned_holdout
from tasks.discover.synthesized import SynthesizedSet
from tasks.runfolder import RunFolder, content_hash
from tasks.runfolder.layout import DISCOVERY_REPORT
from tasks.target.tokenizer import count_prompt_tokens

log = logging.getLogger(__name__)


def _hashed_discover(cfg: DiscoverConfig) -> dict[str, Any]:
    """The discover section as its hash sees it: a key added since runs were committed stays out
    while it holds its default (a file source's kind and synthesis settings, the near-duplicate
    thresholds, the per-domain caps), so those runs keep their hash and are not rediscovered."""
    discover = cfg.model_dump()
    discover.pop("holdout_from")  # the held-out set itself is hashed instead (below)
    if not discover["max_prompt_tokens_by_domain"]:
        discover.pop("max_prompt_tokens_by_domain")
    for key in ("near_duplicate_threshold", "holdout_near_threshold"):
        if discover[key] == DiscoverConfig.model_fields[key].get_default():
            discover.pop(key)
    for source in discover["sources"]:
        if source["kind"] == "file":
            for key in ("kind", *SYNTHESIS_KEYS):
                source.pop(key)
    return discover


def discover_config_hash(cfg: EagleScaleConfig, pinned: PinnedHoldout | None) -> str:
    # The tokenizer decides the length filter, so the target's identity is part of it.
    discover = _hashed_discover(cfg.discover)
    # The held-out set itself, not its path: the earlier run may move (a later session unpacks
    # it elsewhere) and mean the same prompts, or be rediscovered in place and mean others.
    if pinned is not None:
        discover["holdout_from_ids"] = pinned.ids_hash()
    return content_hash({"discover": discover, "target": cfg.target.model_dump()}, 16)


def run_discover_stage(
    cfg: EagleScaleConfig,
    run: RunFolder,
    tokenizer: Any,
    synthesize: Callable[[], SynthesizedSet] | None = None,
) -> dict[str, Any]:
    """Returns the discovery report; `skipped` is True when prompts/ was already committed.

    `synthesize`: writes the synthesized sources' prompts and returns them
    (tasks/synthesize/stage.py::discover_with_synthesis passes it); called only when discovery
    runs, after the configuration and holdout_from were checked."""
    from tasks.discover import discover_prompts
    from tasks.discover.pipeline import check_discover_config

    options = None if run.is_local else cfg.storage_options
    # Read first: its content is part of the config hash, and a bad one fails before any work.
    pinned = load_pinned_holdout(cfg.discover, options)
    config_hash = discover_config_hash(cfg, pinned)
    if check_discovery_config(run, config_hash, cfg.allow_fingerprint_change):
        log.info("prompts/ already committed for this discover config; skipping discovery")
        report = run.read_json(DISCOVERY_REPORT) or {}
        return {"skipped": True, "report": report, "marker": discovery_marker(run)}
    check_discover_config(cfg.discover)  # before the synthesis, which may take hours
    synthesized = synthesize() if synthesize is not None and cfg.discover.synthesized() else None
    result = discover_prompts(cfg.discover, count_prompt_tokens(tokenizer), options, pinned, synthesized)
    marker = commit_discovery(
        run, result.tables(), result.report, result.report_markdown(), config_hash
    )
    return {
        "skipped": False,
        "report": result.report,
        "report_md": result.report_markdown(),
        "marker": marker,
    }
