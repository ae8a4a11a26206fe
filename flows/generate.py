"""Stage flow `generate`: one Prefect task per shard, never per request (docs/DESIGN.md §7).

Per-request state lives in the run folder's journals; Prefect sees shard-sized task runs, a
progress artifact updated in place, and one event per committed shard. Several workers may run
this flow on one run root: each shard runs only under its lease (tasks/runfolder/leases.py),
and every worker keeps going until all shards are committed, by it or by the others.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event

import tasks.story as story
from flows.common import notifier_for, run_logger, slack_on_failure, stage_run
from flows.views import ProgressView
from tasks.config import EagleScaleConfig
from tasks.generate.failures import ShardFailed, ShardStopped, cannot_heal, lasting_failure
from tasks.generate.stage import GenerateStage, open_generate_stage
from tasks.runfolder import CorruptShard
from tasks.runfolder.schedule import ShardScheduler, drive_shards
from tasks.status.figures import progress_figures

# Shard tasks run in this process's thread pool and share one stage (engine, progress).
_active: dict[str, GenerateStage] = {}
# How long a stop waits for the running shards to journal what they have and end: they drop
# their requests at once, so this bounds only a stuck one (its lease is then left to expire).
STOP_WAIT_S = 10.0


def _resource(config: EagleScaleConfig, shard_id: str = "") -> dict[str, str]:
    rid = f"eaglescale.run.{config.run_root}" + (f".shard.{shard_id}" if shard_id else "")
    return {"prefect.resource.id": rid, "eaglescale.run_root": config.run_root}


@task(name="generate-shard", task_run_name="shard-{shard_id}")
def generate_shard(config: EagleScaleConfig, shard_id: str) -> dict[str, Any]:
    stage = _active[config.run_root]
    outcome = stage.run_shard(shard_id)
    summary = {k: v for k, v in asdict(outcome).items() if k != "marker"}
    emit_event(
        f"eaglescale.generate.shard.{outcome.status}",
        resource=_resource(config, shard_id),
        payload=summary,
    )
    return summary


def _worth_retrying(_task: Any, _run: Any, state: Any) -> bool:
    """A shard over its dead-letter bound would fail again: a retry replays the same journaled
    dead letters; so would one failing for a reason no retry heals (another model served, a
    run root refusing writes, a damaged shard its journal cannot rebuild). Anything else (an
    engine that was unavailable for a while, a store hiccup) may pass."""
    error = getattr(state, "data", None)
    if isinstance(error, ShardFailed | ShardStopped | CorruptShard):
        return False
    return not (isinstance(error, BaseException) and cannot_heal(error))


def _run_shards(
    stage: GenerateStage, pending: list[str], config: EagleScaleConfig, view: ProgressView
) -> dict[str, BaseException | str]:
    """Run shards as Prefect tasks until each is committed (here or by another worker) or failed
    here, keeping progress.json, the artifact and stall alerts fresh (tasks/runfolder/schedule.py
    drives them). Returns the failures: the shard task's exception, else its description."""
    g = config.generate
    shard_task = generate_shard.with_options(
        retries=g.shard_retries,
        retry_delay_seconds=g.shard_retry_delay_s,
        retry_condition_fn=_worth_retrying,
    )
    notifier = notifier_for(config)
    log = run_logger()
    stalled_alerted = False

    futures: list[Any] = []

    def start(shard_id: str, report: Any) -> None:
        future = shard_task.submit(config, shard_id)
        futures.append(future)
        future.add_done_callback(report)

    def on_poll() -> None:
        nonlocal stalled_alerted
        if stage.tick():  # progress.json rewritten (every progress_interval_s): mirror it
            view.update(stage.progress.snapshot())
        idle = stage.progress.stalled_for()  # None while results keep arriving
        if idle is not None and not stalled_alerted:
            stalled_alerted = True
            notifier.stalled("generate", idle, dict(progress_figures(stage.progress.snapshot(), time.time())))
            emit_event("eaglescale.generate.stalled", resource=_resource(config), payload={"idle_s": idle})
        elif idle is None:
            stalled_alerted = False

    scheduler = ShardScheduler(stage, pending, g.max_parallel_shards)
    try:
        return drive_shards(
            scheduler,
            start,
            # Polls fast enough to take over an expired lease within about one heartbeat.
            min(5.0, g.progress_interval_s, g.lease_heartbeat_s),
            lambda waiting: log.info("generate: waiting on shards leased elsewhere: %s", waiting),
            on_poll,
            collect=_result_of,
            fatal=cannot_heal,
        )
    except BaseException:
        # A signal (or a failure of this loop): the running shards end now, each journaling
        # what it has, before the leases are released (generate_flow's finally).
        stage.stop()
        deadline = time.monotonic() + STOP_WAIT_S
        for future in futures:
            future.wait(max(deadline - time.monotonic(), 0.0))
        raise


@flow(name="generate", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def generate_flow(config: EagleScaleConfig) -> dict[str, Any]:
    with stage_run(config, "generate") as span:
        stage = open_generate_stage(config, span.run, span.tokenizer)
        _active[config.run_root] = stage
        try:
            pending = stage.prepare()
            span.started({"shards": len(stage.shards), "to_run": len(pending), "engine": config.engine.kind})
            if pending:  # before any shard: the servers serve the target, or the run stops here
                for note in stage.check_servers():
                    span.log.info("generate: %s", note)
            span.log.info("generate: %d shards planned, %d to run", len(stage.shards), len(pending))
            # Opens the server-side stall automation's window before the first shard commits.
            emit_event("eaglescale.generate.started", resource=_resource(config), payload={"to_run": len(pending)})
            view = ProgressView(config, stage.progress.snapshot())  # the bar and the live figures
            failures = _run_shards(stage, pending, config, view)
            summary = stage.finish()
            view.update(stage.progress.snapshot())
            _publish(stage, summary)
        finally:
            stage.close()
            _active.pop(config.run_root, None)
        # The run folder decides: a shard without its marker is not done, whatever Prefect says.
        missing = summary["shards_total"] - summary["shards_committed"]
        if missing and (lasting := lasting_failure(failures, config.run_root)) is not None:
            raise lasting  # one message: the other shards were not started for it
        if missing:
            raise stage.failure(failures or {"?": f"{missing} shard(s) ended without a marker"})
        span.skipped = not pending  # every shard was committed, and whole, before this run
        span.summary = summary
    emit_event("eaglescale.generate.finished", resource=_resource(config), payload=summary)
    return summary


def _result_of(future: Any) -> dict[str, Any] | BaseException:
    result = future.result(raise_on_failure=False)
    if isinstance(result, BaseException | dict):
        return result
    return RuntimeError(f"shard task ended without a result: {result!r}")


def _publish(stage: GenerateStage, summary: dict[str, Any]) -> None:
    committed = stage.store.committed()
    rows = []
    for shard in stage.shards:
        m = committed.get(shard.shard_id)
        rows.append(
            {
                "shard": shard.shard_id,
                "state": "committed" if m else "missing",
                "rows": m["rows"] if m else 0,
                "dead": m["dead"] if m else 0,
                "completion_tokens": m.get("completion_tokens", 0) if m else 0,
            }
        )
    create_table_artifact(rows, key="generate-shards", description="Generation shards")
    lines = ["# Generation summary", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in story.completed("generate", summary)[1].items()]
    create_markdown_artifact("\n".join(lines), key="generate-summary", description="Generation summary")
