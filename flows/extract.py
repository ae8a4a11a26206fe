"""Stage flow `extract`: the target's aux and last hidden states for every committed
generation row, one Prefect task per shard, with the disk forecast shown before any work.

Several workers may run this flow on one run root: each shard runs only under its lease, and
every worker keeps going until all its planned shards are committed, by it or by the others
(waiting on shards live workers hold, taking over those of dead ones).

With `follow_since` (the parent flow's `orchestration.overlap`) the flow runs alongside
generation: it takes each generation shard as its marker appears and ends once generation is
complete and every marked shard is extracted, or once generation ended without completing
(tasks/extract/follow.py)."""

from __future__ import annotations

import threading
from dataclasses import asdict
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event

import tasks.humanize as humanize
from flows.common import slack_on_failure, stage_run
from flows.concurrency import gpu_slots, gpus_needed
from tasks.config import EagleScaleConfig
from tasks.extract.follow import follow_generation, generation_ended_since
from tasks.extract.forecast import online_forecast
from tasks.extract.stage import ExtractStage
from tasks.runfolder import RunFolder
from tasks.runfolder.schedule import ShardScheduler, run_one_at_a_time
from tasks.runlog import brief

_active: dict[str, ExtractStage] = {}
# Set by the parent flow when its in-process generation subflow has returned or raised, also
# where generation's stage clock never got written (a failure before the stage began).
_generation_over: dict[str, threading.Event] = {}


def generation_over(run_root: str) -> threading.Event:
    """A fresh event for this run root that an in-process follower (`extract_flow(follow_since=
    ...)`) also stops on; the parent sets it once its generation subflow is over."""
    event = _generation_over[run_root] = threading.Event()
    return event


@task(name="extract-shard", task_run_name="extract-{shard_id}")
def extract_shard(config: EagleScaleConfig, shard_id: str) -> dict[str, Any]:
    outcome = _active[config.run_root].run_shard(shard_id)
    summary = {k: v for k, v in asdict(outcome).items() if k != "marker"}
    emit_event(
        f"eaglescale.extract.shard.{outcome.status}",
        resource={"prefect.resource.id": f"eaglescale.run.{config.run_root}.extract.{shard_id}"},
        payload=summary,
    )
    return summary


def _forecast_markdown(forecast: dict[str, Any]) -> str:
    lines = ["# Extraction disk forecast", "", "| field | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in humanize.fields(forecast).items()]
    return "\n".join(lines)


def skip_online(config: EagleScaleConfig, run: RunFolder) -> dict[str, Any]:
    """The parent flow's stand-in for this stage when train.hidden_states is online: nothing
    runs, the forecast (0 bytes) is shown where the extraction's would be."""
    forecast = online_forecast(run, config.extract.max_length)
    create_markdown_artifact(_forecast_markdown(forecast), key="extract-forecast",
                             description="Disk forecast (online hidden states: nothing stored)")  # fmt: skip
    return {"skipped": "train.hidden_states is online", "forecast": forecast["summary"]}


@flow(name="extract", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def extract_flow(config: EagleScaleConfig, follow_since: float | None = None) -> dict[str, Any]:
    """`follow_since`: generation was started at this UNIX time and runs alongside; extract its
    shards as they are marked (None: extract what generation committed, once)."""
    with stage_run(config, "extract") as span:
        stage = ExtractStage(config, span.run, span.tokenizer)
        _active[config.run_root] = stage
        try:
            pending = stage.prepare()  # refuses here, before any work, when the forecast does not fit
            create_markdown_artifact(
                _forecast_markdown(stage.forecast), key="extract-forecast", description="Disk forecast"
            )
            following = {"following_generation": True} if follow_since is not None else {}
            span.started({"shards_to_run": len(pending), **following, **stage.forecast})
            span.log.info("extract: %d shards to run%s; forecast %s", len(pending),
                          " so far, following generation" if following else "", brief(stage.forecast))  # fmt: skip
            outcomes: list[dict[str, Any]] = []

            def run_one(shard_id: str) -> dict[str, Any]:
                outcomes.append(extract_shard(config, shard_id))
                return outcomes[-1]

            # Polls fast enough to take over an expired lease within about one heartbeat.
            poll = min(5.0, config.extract.lease_heartbeat_s)

            def on_wait(waiting: dict[str, str]) -> None:
                span.log.info("extract: waiting on shards leased elsewhere: %s", waiting)

            with gpu_slots(config, gpus_needed(config, "extract")):
                if follow_since is None:
                    # One model per process: shards run one after another on it.
                    scheduler = ShardScheduler(stage, pending, max_running=1)
                    failures = run_one_at_a_time(scheduler, run_one, poll, on_wait)
                else:
                    over = _generation_over.get(config.run_root)  # None: run as a deployment
                    failures = follow_generation(
                        stage,
                        run_one,
                        # New markers are picked up within a second: an idle model is the cost.
                        min(1.0, poll),
                        lambda: (over is not None and over.is_set())
                        or generation_ended_since(span.run, follow_since),
                        on_wait,
                    )
            summary = stage.finish()
        finally:
            stage.close()
            _active.pop(config.run_root, None)
        if outcomes:
            create_table_artifact(outcomes, key="extract-shards", description="Extraction shards")
        # The run folder decides: a shard without its marker is not done, whatever Prefect says.
        if summary["shards_pending"]:
            shown = [f"{k}: {v}" for k, v in sorted(failures.items())][:3]
            raise RuntimeError(f"extract: {summary['shards_pending']} shard(s) not extracted: {shown}")
        # Nothing extracted here and nothing left: an earlier run did the stage.
        span.skipped = summary["complete"] and not any(o.get("status") == "committed" for o in outcomes)
        span.summary = summary
    return summary
