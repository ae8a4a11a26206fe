"""Stage flow `gate`: does the trained draft make decoding faster? Promote it only if it does.

The work is tasks.gate.stage.run_gate_once (run_gate_stage, unless this draft was decided
already); this flow shows it: the report (with its plots)
and a table of configs as artifacts, an `eaglescale.gate.<outcome>` event, and the decision
with its key numbers on Slack.
"""

from __future__ import annotations

import base64
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event

from flows.common import StageRun, slack_on_failure, stage_run
from flows.concurrency import gpu_slots, gpus_needed
from tasks.config import EagleScaleConfig
from tasks.gate.report import REPORT_MD
from tasks.gate.stage import GateOutcome, run_gate_once
from tasks.notify import format_duration
from tasks.runfolder import RunFolder

SUMMARY_KEYS = ("outcome", "promoted", "best_config", "speedup", "ci", "message")
CONFIG_COLUMNS = ("name", "median_tok_s", "spread", "speedup", "ci_low", "ci_high", "accept_length",
                  "exact_match_fraction", "eligible")  # fmt: skip


def _report_markdown(run: RunFolder, outcome: GateOutcome) -> str:
    """report.md with its plots inlined: the artifact must stand alone in the UI."""
    text = run.read_bytes(REPORT_MD).decode()
    for rel in outcome.report["plots"]:
        png = base64.b64encode(run.read_bytes(rel)).decode()
        name = rel.rsplit("/", 1)[-1].removesuffix(".png")
        text += f"\n\n### {name}\n\n![{name}](data:image/png;base64,{png})"
    return text


def decision_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """The key numbers Slack shows for a decision."""
    fields = {
        "decision": summary["outcome"],
        "best config": summary.get("best_config"),
        "baseline tok/s": summary.get("baseline_median_tok_s"),
        "best tok/s": summary.get("best_median_tok_s"),
        "speedup": summary.get("speedup"),
        "CI": summary.get("ci"),
        "accept length": summary.get("accept_length"),
        "exact match": summary.get("exact_match_fraction"),
    }
    inc = summary.get("incumbent")
    if inc:
        margin = (f"{inc['margin']:.3f}x [{inc['ci'][0]:.3f}, {inc['ci'][1]:.3f}]" if inc.get("margin") is not None
                  else f"not measured: {inc.get('not_measured', 'no eligible config of the new draft')}")  # fmt: skip
        fields["vs incumbent"] = f"{inc['draft_id']} ({inc.get('config')}): {margin}"
    # Every draft at its best config, one line each: the side-by-side of the report, in short.
    fields["contenders"] = "; ".join(contender_line(c) for c in summary.get("contenders") or []) or None
    fields["left out"] = "; ".join(f"{x['name']}: {x['reason']}" for x in summary.get("left_out") or []) or None
    if summary.get("promoted"):
        fields["published"] = summary.get("uri")
    else:
        fields["kept"] = (summary.get("previous_draft") or {}).get("draft_id") or "none promoted yet"
        fields["why"] = "; ".join(summary.get("reasons") or [])
    return {k: v for k, v in fields.items() if v is not None}


def contender_line(c: dict[str, Any]) -> str:
    """`name config: median tok/s, speedup [CI], accept length, exact match, vs incumbent`."""
    if c.get("median_tok_s") is None or c.get("config") is None:
        return f"{c['name']}: not measured"
    parts = [f"{c['median_tok_s']:.1f} tok/s"]
    if c.get("speedup") is not None:
        parts.append(f"{c['speedup']:.3f}x [{c['ci_low']:.3f}, {c['ci_high']:.3f}]")
    if c.get("accept_length") is not None:
        parts.append(f"accept {c['accept_length']:.2f}")
    if c.get("exact_match_fraction") is not None:
        parts.append(f"exact {c['exact_match_fraction']:.0%}")
    if c.get("vs_incumbent"):
        parts.append(f"vs incumbent {c['vs_incumbent'][0]:.3f}x")
    # The incumbent's and challengers' config names already carry their contender's name.
    label = c["config"] if str(c["config"]).startswith(f"{c['name']}:") else f"{c['name']} {c['config']}"
    return f"{label}: " + ", ".join(parts) + ("" if c.get("eligible") else " (not eligible)")


@flow(name="gate", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def gate_flow(config: EagleScaleConfig) -> dict[str, Any]:
    with stage_run(config, "gate") as span:
        return _gate(config, span)


def _gate(config: EagleScaleConfig, span: StageRun) -> dict[str, Any]:
    outcome = run_gate_once(  # its progress lines show in the UI
        config, span.log, hold=gpu_slots(config, gpus_needed(config, "gate")),
        on_start=lambda: span.started({"engine": config.gate.engine, "num_steps": config.gate.num_steps}),
    )  # fmt: skip
    if not isinstance(outcome, GateOutcome):
        span.log.info("gate: this draft was already decided with these settings: %s", outcome["message"])
        span.skipped = True
        return {k: outcome.get(k) for k in SUMMARY_KEYS} | {"skipped": True}
    summary = outcome.summary
    span.log.info("gate: %s", summary["message"])
    create_markdown_artifact(_report_markdown(span.run, outcome), key="gate-report", description="Gate decision")
    rows = [{k: getattr(c, k) for k in CONFIG_COLUMNS} for c in outcome.decision.configs]
    create_table_artifact(rows, key="gate-configs", description="Baseline and speculative configs")
    emit_event(
        f"eaglescale.gate.{summary['outcome']}",
        resource={"prefect.resource.id": f"eaglescale.run.{config.run_root}.gate"},
        payload={k: v for k, v in summary.items() if k != "message"},
    )
    # The decision is the gate's completion message: one message, the numbers in it.
    fields = {**decision_fields(summary), "duration": format_duration(span.elapsed_s)}
    span.notifier.send(f"gate: {summary['outcome'].upper()}", fields, "success" if summary.get("promoted") else "warning")
    return {k: summary.get(k) for k in SUMMARY_KEYS}
