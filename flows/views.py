"""What the Prefect UI shows a watcher, each view one artifact updated in place:

- `RunSummary`, on the parent run `data-scaling` (the first page a watcher opens): each stage's
  state, clock, key numbers and a link to its own run (where its artifacts are), ending with the
  gate's decision; and the run's last log line, in words.
- `ProgressView`, on the generate run: Prefect's progress bar and beside it the figures a
  40-hour watcher checks (tasks/status/figures.py, the same rows `eaglescale status` and the
  stall alert show).

The figures come from the run folder (tasks/status/read.py), so a stage that ran as a child
deployment, or in an earlier run, shows its numbers too. Showing never fails a run: a view
that cannot be updated is a warning.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)

import tasks.humanize as h
from flows.common import run_logger
from tasks.config import EagleScaleConfig
from tasks.redaction import redact_text, redact_url
from tasks.runfolder import RunFolder
from tasks.runlog import brief
from tasks.status.figures import progress_markdown, stage_figures
from tasks.status.read import StatusError, read_status

RUN_SUMMARY_KEY = "run-summary"
PROGRESS_KEY, PROGRESS_TABLE_KEY = "generate-progress", "generate-live"
OUTCOME_WORDS = {"promote": "PROMOTED", "reject": "REJECTED, not promoted", "stopped": "STOPPED, not promoted"}
# Words, not emoji: a browser without an emoji font shows boxes.
STATE_WORDS = {"completed": "completed", "running": "running", "failed": "**FAILED**", "stopped": "**STOPPED**"}


def update_markdown(artifact_id: UUID | None, markdown: str) -> None:
    """Replace a markdown artifact's text in place (Prefect has no helper for it: a new
    artifact of the same key would be a second entry in the run's Artifacts tab)."""
    if artifact_id is None:
        return
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    try:
        get_client(sync_client=True).update_artifact(artifact_id=artifact_id, artifact=ArtifactUpdate(data=markdown))
    except Exception as e:  # the UI lags, the run goes on
        run_logger().warning("could not update artifact %s: %s", artifact_id, brief(e, 200))


class ProgressView:
    """Generation's progress bar and live figures, both created now and updated in place."""

    def __init__(self, config: EagleScaleConfig, snapshot: Mapping[str, Any]) -> None:
        self.title = "Generation, live"
        self.run_root = config.run_root
        self.bar = create_progress_artifact(
            _percent(snapshot), key=PROGRESS_KEY, description=f"Generation progress of {config.run_root}"
        )
        self.table = create_markdown_artifact(
            progress_markdown(snapshot, time.time(), self.title, self.run_root), key=PROGRESS_TABLE_KEY,
            description="Generation, live: requests, tokens, rate, ETA, dead letters, shards, servers",
        )  # fmt: skip

    def update(self, snapshot: Mapping[str, Any]) -> None:
        try:
            update_progress_artifact(self.bar, _percent(snapshot))
        except Exception as e:
            run_logger().warning("could not update the progress bar: %s", brief(e, 200))
        update_markdown(self.table, progress_markdown(snapshot, time.time(), self.title, self.run_root))


def _percent(snapshot: Mapping[str, Any]) -> float:
    return float(snapshot.get("percent") or 0.0)


class RunSummary:
    """The parent run's summary artifact: created at the start, refreshed at every stage's
    start and end (`refresh`), and at the end (`finish`, `failed`)."""

    def __init__(self, config: EagleScaleConfig) -> None:
        self.config = config
        self.run = RunFolder(config.run_root, config.storage_options)
        self.began = time.time()
        self.current: list[str] = []  # the stages running now (two with orchestration.overlap)
        self.outcome: str | None = None  # None while running; "finished" or the failure
        self.artifact_id: UUID | None = None
        self.artifact_id = create_markdown_artifact(
            self.markdown(), key=RUN_SUMMARY_KEY, description="Where the run is and what it decided"
        )

    def stage(self, name: str, running: bool) -> None:
        """A stage starts (`running`) or has ended: refresh the summary."""
        if running:
            self.current.append(name)
        elif name in self.current:
            self.current.remove(name)
        self.refresh()

    def refresh(self) -> None:
        update_markdown(self.artifact_id, self.markdown())

    def failed(self, error: BaseException) -> None:
        where = ", ".join(self.current) or "the parent flow"
        # Free text from an exception: a URL's credentials or a known secret never land here.
        self.outcome = f"FAILED in {where}: {type(error).__name__}: {redact_url(redact_text(str(error)))[:300]}"
        self.refresh()

    def finish(self) -> str:
        """The final summary; returns the run's last log line."""
        self.outcome = "finished"
        self.refresh()
        status = self._status()
        figures = stage_figures(status) if status else {}
        decision = figures.get("gate") or "no gate decision in this run"
        done = "; ".join(f"{s} {figures[s]}" for s in self.config.stages if s != "gate" and figures.get(s))
        return f"data-scaling finished in {h.duration(time.time() - self.began)}: {decision}" + (f". {done}" if done else "")

    def _status(self) -> dict[str, Any] | None:
        try:
            return read_status(self.run)
        except StatusError:  # nothing recorded yet (before the run's fingerprint is written)
            return None

    def markdown(self) -> str:
        status = self._status()
        figures = stage_figures(status) if status else {}
        clocks = (status or {}).get("stages") or {}
        links = _stage_links()
        lines = [f"# {self._headline(figures)}", ""]
        gate = (status or {}).get("gate") or {}
        if figures.get("gate"):
            lines += [f"**Decision: {figures['gate']}.** Promoted draft: {gate.get('promoted_draft') or 'none'}.", ""]
            if gate.get("message"):
                lines += [f"> {gate['message']}", ""]
        lines += ["| stage | state | time | key numbers | its run |", "|---|---|---|---|---|"]
        for name in self.config.stages:
            state, took = self._clock(name, clocks.get(name))
            numbers = "live figures in its run" if state.endswith("running") else (figures.get(name) or "")
            lines.append(f"| {name} | {state} | {took} | {numbers} | {links.get(name, '')} |")
        lines += ["", f"Run folder `{self.config.run_root}` · started {h.clock(self.began)} · "
                      f"updated {h.clock(time.time())} · `eaglescale status {self.config.run_root}` from a terminal"]  # fmt: skip
        return "\n".join(lines) + "\n"

    def _headline(self, figures: Mapping[str, str | None]) -> str:
        if self.outcome and self.outcome != "finished":
            return self.outcome
        if self.outcome == "finished":
            decided = (figures.get("gate") or "").split(":", 1)[0].lower()  # promote, reject or stopped
            return f"Finished: {OUTCOME_WORDS.get(decided, decided.upper())}" if decided else "Finished"
        if self.current:
            stages = list(self.config.stages)
            at = ", ".join(f"{s} ({stages.index(s) + 1} of {len(stages)})" for s in self.current if s in stages)
            return f"Running: {at}"
        return "Starting"

    def _clock(self, name: str, clock: Mapping[str, Any] | None) -> tuple[str, str]:
        """(state, time) of a stage from its clock (stages/<name>.json)."""
        if clock is None:
            return ("starting" if name in self.current else "pending"), ""
        state = STATE_WORDS.get(str(clock["state"]), str(clock["state"]))
        if clock["state"] == "running":
            return state, f"since {h.clock(clock['started_at'])}"
        took = h.duration(max(0.0, (clock.get("ended_at") or time.time()) - clock["started_at"]))
        if clock["state"] == "completed" and clock["started_at"] < self.began:
            return "completed in an earlier run", took  # resumed: this run found its work done
        return state, took


def _stage_links() -> dict[str, str]:
    """Each stage's own run in the UI (its artifacts), by stage name: the child flow runs of
    this flow run, the subflows and child deployments alike."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.context import FlowRunContext
    from prefect.utilities.urls import url_for

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return {}
    try:
        client = get_client(sync_client=True)
        # limit and sort spelled out: the client sends null for either left unset, and a server
        # that reads null as a wrong type answers 422 (the GPU node's did: BENCHMARKS P35).
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[context.flow_run.id])),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=200)  # fmt: skip
        names = {fid: client.read_flow(fid).name for fid in {r.flow_id for r in runs}}
    except Exception as e:  # the summary without its links
        run_logger().warning("run summary: could not list the stage runs: %s", brief(e, 200))
        return {}
    links: dict[str, str] = {}
    for run in sorted(runs, key=lambda r: r.created.timestamp() if r.created else 0.0):  # the latest run of a stage wins
        url = url_for("flow-run", obj_id=run.id)
        text = f"{names[run.flow_id]} / {run.name}"
        links[names[run.flow_id]] = f"[{text}]({url}?tab=Artifacts)" if url else text
    return links
