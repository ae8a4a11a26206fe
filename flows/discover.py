"""Stage flow `discover`: sources -> prompts/manifest.parquet, with a report in the UI."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.common import notifier_for, run_logger, slack_on_failure
from tasks.config import EagleScaleConfig
from tasks.discover.stage import run_discover_stage
from tasks.runfolder import RunFolder
from tasks.target import load_tokenizer


def _table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for scope, key in (("source", "sources"), ("domain", "domains")):
        for name, counts in (report.get(key) or {}).items():
            rows.append({"scope": scope, "name": name, **{k: v for k, v in counts.items() if isinstance(v, int)}})
    return rows


@flow(name="discover", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def discover_flow(config: EagleScaleConfig) -> dict[str, Any]:
    log = run_logger()
    notifier = notifier_for(config)
    started = time.time()
    notifier.stage_started("discover", {"sources": len(config.discover.sources)})
    run = RunFolder(config.run_root, config.storage_options)
    tokenizer = load_tokenizer(config.target.model_path, config.target.chat_template)
    result = run_discover_stage(config, run, tokenizer)
    report = result["report"]
    totals = report.get("totals", {})
    if not result["skipped"]:
        create_markdown_artifact(result["report_md"], key="discovery-report", description="Discovery report")
        rows = _table_rows(report)
        if rows:
            create_table_artifact(rows, key="discovery-counts", description="Rows per source and domain")
    log.info("discover: %s", {k: totals.get(k) for k in ("rows_read", "kept", "malformed", "holdout")})
    notifier.stage_completed("discover", {"skipped": result["skipped"], **totals}, time.time() - started)
    return {"skipped": result["skipped"], "totals": totals, "manifest_hash": result["marker"]["manifest_hash"]}
