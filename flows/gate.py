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

import tasks.humanize as h
from flows.common import StageRun, slack_on_failure, stage_run
from flows.concurrency import gpu_slots, gpus_needed
from tasks.config import EagleScaleConfig
from tasks.gate.decision import GateDecision
from tasks.gate.report import REPORT_MD, verdict
from tasks.gate.stage import GateOutcome, run_gate_once
from tasks.runfolder import RunFolder

SUMMARY_KEYS = ("outcome", "promoted", "best_config", "speedup", "ci", "message")


def config_rows(decision: GateDecision) -> list[dict[str, str]]:
    """The UI's table of configs: six columns that fit, figures as people read them, and a
    verdict that cannot be read against the decision (tasks/gate/report.py `verdict`)."""
    return [
        {
            "config": c.name,
            "median tok/s": h.number(c.median_tok_s),
            "spread": h.percent(c.spread),
            "speedup [CI]": "1x (reference)" if c.baseline else h.speedup(c.speedup, c.ci_low, c.ci_high),
            "accept length": h.fixed(c.accept_length),
            "verdict": "reference" if c.baseline else verdict(decision, c.name, c.role, c.eligible, c.reasons),
        }
        for c in decision.configs
    ]


def _report_markdown(run: RunFolder, outcome: GateOutcome) -> str:
    """report.md with its plots inlined: the artifact must stand alone in the UI."""
    text = run.read_bytes(REPORT_MD).decode()
    for rel in outcome.report["plots"]:
        png = base64.b64encode(run.read_bytes(rel)).decode()
        name = rel.rsplit("/", 1)[-1].removesuffix(".png")
        text += f"\n\n### {name}\n\n![{name}](data:image/png;base64,{png})"
    return text


def decision_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """The key numbers Slack shows for a decision, each as a person reads it (tasks/humanize.py)."""
    ci = summary.get("ci") or [None, None]
    fields = {
        "decision": str(summary["outcome"]).upper(),
        "best config": summary.get("best_config"),
        "baseline tok/s": summary.get("baseline_median_tok_s"),
        "best tok/s": summary.get("best_median_tok_s"),
        "speedup": h.speedup(summary["speedup"], *ci) if summary.get("speedup") is not None else None,
        "accept length": summary.get("accept_length"),
        "exact match": h.percent(summary["exact_match_fraction"]) if summary.get("exact_match_fraction") is not None else None,
    }  # fmt: skip
    inc = summary.get("incumbent")
    if inc:
        margin = (h.speedup(inc["margin"], *inc["ci"]) if inc.get("margin") is not None
                  else f"not measured: {inc.get('not_measured', 'no eligible config of the new draft')}")  # fmt: skip
        fields["vs incumbent"] = f"{inc['draft_id']} ({inc.get('config')}): {margin}"
    # Every draft at its best config, one line each: the side-by-side of the report, in short.
    fields["contenders"] = "; ".join(contender_line(c) for c in summary.get("contenders") or []) or None
    fields["left out"] = "; ".join(f"{x['name']}: {x['reason']}" for x in summary.get("left_out") or []) or None
    if summary.get("promoted"):
        fields["published"] = summary.get("uri")
    else:
        fields["kept"] = (summary.get("previous_draft") or {}).get("draft_id") or "none promoted yet"
        fields["why"] = "; ".join(summary.get("reasons") or []) or None
    return {k: v for k, v in fields.items() if v is not None}


def decision_headline(summary: dict[str, Any]) -> str:
    """The decision's figures in one line, after its title (`gate: REJECT`): `speedup 0.839x
    [0.685, 1.38] at eagle3-s1-k1-n2; not promoted`."""
    ci = summary.get("ci") or [None, None]
    parts = [f"speedup {h.speedup(summary['speedup'], *ci)}"] if summary.get("speedup") is not None else []
    if summary.get("best_config"):
        parts.append(f"at {summary['best_config']}")
    return " ".join(parts) + ("; " if parts else "") + ("published" if summary.get("promoted") else "not promoted")


def contender_line(c: dict[str, Any]) -> str:
    """`name config: median tok/s, speedup [CI], accept length, exact match, vs incumbent`."""
    if c.get("median_tok_s") is None or c.get("config") is None:
        return f"{c['name']}: not measured"
    parts = [f"{h.number(c['median_tok_s'])} tok/s"]
    if c.get("speedup") is not None:
        parts.append(h.speedup(c["speedup"], c.get("ci_low"), c.get("ci_high")))
    if c.get("accept_length") is not None:
        parts.append(f"accept {h.fixed(c['accept_length'])}")
    if c.get("exact_match_fraction") is not None:
        parts.append(f"exact {h.percent(c['exact_match_fraction'])}")
    if c.get("vs_incumbent"):
        parts.append(f"vs incumbent {h.speedup(c['vs_incumbent'][0])}")
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
    # report.md's wide tables split to fit the UI (the file keeps them whole, for a terminal).
    create_markdown_artifact(h.fit_tables(_report_markdown(span.run, outcome)), key="gate-report", description="Gate decision")
    create_table_artifact(config_rows(outcome.decision), key="gate-configs", description="Baseline and speculative configs")
    emit_event(
        f"eaglescale.gate.{summary['outcome']}",
        resource={"prefect.resource.id": f"eaglescale.run.{config.run_root}.gate"},
        payload={k: v for k, v in summary.items() if k != "message"},
    )
    # The decision is the gate's completion message: one message, the numbers in it.
    fields = {**decision_fields(summary), "duration": h.duration(span.elapsed_s)}
    level = "success" if summary.get("promoted") else "warning"
    span.notifier.send(f"gate: {summary['outcome'].upper()}", fields, level, decision_headline(summary))
    return {k: summary.get(k) for k in SUMMARY_KEYS}
