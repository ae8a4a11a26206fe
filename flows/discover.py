"""Stage flow `discover`: sources -> prompts/manifest.parquet, with a report in the UI."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.common import slack_on_failure, stage_run
from tasks.config import EagleScaleConfig
from tasks.synthesize.stage import discover_with_synthesis


def _table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for scope, key in (("source", "sources"), ("domain", "domains")):
        for name, counts in (report.get(key) or {}).items():
            rows.append({"scope": scope, "name": name, **{k: v for k, v in counts.items() if isinstance(v, int)}})
    return rows


@flow(name="discover", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def discover_flow(config: EagleScaleConfig) -> dict[str, Any]:
    with stage_run(config, "discover") as span:
        span.started({"sources": len(config.discover.sources)})
        # A synthesized source's prompts are written first (through generation's shards).
        result = discover_with_synthesis(config, span.run, span.tokenizer)
        report = result["report"]
        totals = report.get("totals", {})
        if not result["skipped"]:
            create_markdown_artifact(result["report_md"], key="discovery-report", description="Discovery report")
            rows = _table_rows(report)
            if rows:
                create_table_artifact(rows, key="discovery-counts", description="Rows per source and domain")
        span.log.info("discover: %s", {k: totals.get(k) for k in ("rows_read", "kept", "malformed", "holdout")})
        span.summary = {"skipped": result["skipped"], **totals}
    return {"skipped": result["skipped"], "totals": totals, "manifest_hash": result["marker"]["manifest_hash"]}
