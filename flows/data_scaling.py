"""The parent flow `data-scaling`: the whole DAG, one subflow per stage.

discover -> generate -> extract -> train -> gate (benchmark, decision, promotion); with
`train.hidden_states: online` the trainer captures the states itself and extract is skipped. A stage named
in `orchestration.stage_deployments` runs as that deployment (e.g. on a GPU work pool) through
`run_deployment`, a child flow run of this one; the others run in this process as subflows.

With `orchestration.overlap: true` (and offline hidden states) extract runs alongside generate,
in a second thread of this flow run: it takes each generation shard as its marker appears and
ends once generate/_COMPLETE is written and every marked shard is extracted. Training starts as
soon as its input is complete, as before (after extract, or after generate when online).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from typing import Any

from prefect import flow
from prefect.context import FlowRunContext
from prefect.deployments import run_deployment
from prefect.task_runners import ThreadPoolTaskRunner

from flows.common import run_logger, slack_on_failure
from flows.concurrency import run_root_lock
from flows.discover import discover_flow
from flows.generate import generate_flow
from flows.views import RunSummary
from tasks.config import EagleScaleConfig
from tasks.extract.follow import generation_started_since
from tasks.fingerprint_fields import run_fingerprint
from tasks.generate.stage import generation_fingerprint
from tasks.runfolder import RunFolder, check_fingerprint
from tasks.runlog import brief
from tasks.target.identity import target_identity
from tasks.target.tokenizer import load_tokenizer


def run_stage(config: EagleScaleConfig, stage: str, subflow: Any, after: Any = None, **params: Any) -> Any:
    """The stage as a subflow, or as its deployment when the config names one; a child run
    that does not complete fails the parent with its state. `after`: the result of the stage
    before it, which the run graph draws as its edge (a subflow waits for it)."""
    deployment = config.orchestration.stage_deployments.get(stage)  # type: ignore[call-overload]
    if deployment is None:
        return edge_only(subflow(config, wait_for=[after] if after is not None else None, **params))
    child = run_deployment(
        deployment, parameters={"config": config.model_dump(mode="json"), **params}, timeout=None
    )
    state = child.state
    if state is None or not state.is_completed():
        name = state.name if state else "unknown"
        raise RuntimeError(f"stage {stage}: deployment {deployment!r} run {child.name} ended {name}: {state.message if state else ''}")
    return {"deployment": deployment, "flow_run": child.name, "state": state.name}


def generate_and_extract(
    config: EagleScaleConfig, run: RunFolder, tokenizer: Any, generate: Callable[[], Any], extract: Callable[..., Any]
) -> tuple[Any, Any]:
    """`generate()` here while extraction follows it in a second thread (a subflow of this flow
    run, or its deployment). A generation failure is raised once extraction has stopped (it
    starts no shard after it and commits the one in flight); otherwise both results."""
    from flows.extract import generation_over

    # run.json first: extraction refuses to start without the run's fingerprint, which
    # generation would otherwise record only once its subflow has begun.
    generation_fingerprint(config, run, tokenizer)
    over = generation_over(config.run_root)
    since = time.time()

    def follow() -> Any:
        # Generation is the critical path: it starts first, and extraction loads its model
        # while generation's first shards run.
        while not (over.is_set() or generation_started_since(run, since)):
            time.sleep(0.1)
        return extract(follow_since=since)

    context = contextvars.copy_context()  # the parent's flow run: extract shows as its subflow
    with ThreadPoolExecutor(1, thread_name_prefix="extract") as pool:
        extracting = pool.submit(context.run, follow)
        try:
            generated = generate()
        finally:
            over.set()  # also where generation failed before its stage clock was written
        return generated, extracting.result()


def edge_only(result: Any) -> Any:
    """The stage's result, drawn in the run graph as a whole only. Prefect links a subflow's
    result and each of its values to the subflow, and a later stage's `config` holding an equal
    object (the same storage_dtype string, say) drew an edge from an unrelated stage (extract ->
    gate, generate -> gate); `wait_for` draws the real one."""
    context = FlowRunContext.get()
    if context is not None and isinstance(result, dict):
        for value in result.values():
            context.run_results.pop(id(value), None)
    return result


def with_run_root(config: EagleScaleConfig, run_root: str) -> EagleScaleConfig:
    """The config on another run folder; a relative one resolves against the working
    directory (a deployment's: the checkout its pull step moved to)."""
    return EagleScaleConfig.model_validate({**config.model_dump(mode="json"), "run_root": run_root})


@flow(name="data-scaling", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def data_scaling(config: EagleScaleConfig, run_root: str | None = None) -> dict[str, Any]:
    """`run_root`: another run folder than the config's, for a fresh run of the same profile
    (`prefect deployment run 'data-scaling/local-smoke' --param run_root=...`)."""
    if run_root is not None:
        config = with_run_root(config, run_root)
    summary = RunSummary(config)  # the parent run's first screen (flows/views.py)
    try:
        results = run_stages(config, summary)
    except BaseException as e:
        summary.failed(e)
        raise
    run_logger().info(summary.finish())
    return results


def run_stages(config: EagleScaleConfig, summary: RunSummary) -> dict[str, Any]:
    """The configured stages in order, each shown in the summary as it starts and ends and
    drawn in the run graph after the stage before it."""
    log = run_logger()
    run = RunFolder(config.run_root, config.storage_options)
    tokenizer = load_tokenizer(config.target.model_path, config.target.chat_template)
    identity = target_identity(config.target.model_path, config.target.revision, tokenizer)
    # Refuse a mismatched resume before any work, on the fields known before discovery.
    check_fingerprint(
        run, run_fingerprint(config, identity, None), config.allow_fingerprint_change, partial=True
    )
    results: dict[str, Any] = {"run_root": config.run_root}

    def stage(name: str, subflow: Any, after: Any = None, **params: Any) -> Any:
        summary.stage(name, running=True)
        result = run_stage(config, name, subflow, after, **params)
        summary.stage(name, running=False)
        return result

    if "discover" in config.stages:
        results["discover"] = stage("discover", discover_flow)
    online = config.train.hidden_states == "online"
    overlap = config.orchestration.overlap and not online and {"generate", "extract"} <= set(config.stages)
    # The later stages' flows are imported when the run has them: a run of discover or
    # generate alone (a resume, a node's stage) starts without the trainer's and the gate's
    # imports (matplotlib among them) and their flows' parameter schemas.
    if "extract" in config.stages:
        from flows.extract import extract_flow, skip_online
    if "generate" in config.stages:
        runner = ThreadPoolTaskRunner(max_workers=config.generate.max_parallel_shards)
        subflow = generate_flow.with_options(task_runner=runner)
        slots = config.orchestration.generate_runs_per_run_root

        def generate() -> Any:
            with run_root_lock(config, "generate", slots=slots) if slots else nullcontext():
                return stage("generate", subflow, results.get("discover"))

        if overlap:
            extract = partial(stage, "extract", extract_flow, results.get("discover"))
            results["generate"], results["extract"] = generate_and_extract(config, run, tokenizer, generate, extract)
        else:
            results["generate"] = generate()
    if "extract" in config.stages and online:
        # The trainer captures the states itself: nothing to extract, nothing stored.
        results["extract"] = skip_online(config, run)
        log.info("extract: skipped, %s", brief(results["extract"]["forecast"]))
    elif "extract" in config.stages and not overlap:
        results["extract"] = stage("extract", extract_flow, results.get("generate"))
    if "train" in config.stages:
        from flows.train import train_flow

        results["train"] = stage("train", train_flow, results.get("generate" if online else "extract"))
    if "gate" in config.stages:
        from flows.gate import gate_flow

        results["gate"] = stage("gate", gate_flow, results.get("train"))
    return results
