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
from typing import Any

from prefect import flow
from prefect.deployments import run_deployment
from prefect.task_runners import ThreadPoolTaskRunner

from flows.common import run_logger, slack_on_failure
from flows.concurrency import run_root_lock
from flows.discover import discover_flow
from flows.extract import extract_flow, generation_over, skip_online
from flows.gate import gate_flow
from flows.generate import generate_flow
from flows.train import train_flow
from tasks.config import EagleScaleConfig
from tasks.extract.follow import generation_started_since
from tasks.fingerprint_fields import run_fingerprint
from tasks.generate.stage import generation_fingerprint
from tasks.runfolder import RunFolder, check_fingerprint
from tasks.runlog import brief
from tasks.target.identity import target_identity
from tasks.target.tokenizer import load_tokenizer


def _outcome(result: Any) -> Any:
    """A stage's result in a word or two, for the run's last log line."""
    if not isinstance(result, dict):
        return result
    if result.get("skipped"):
        return "skipped"
    keys = ("shards_committed", "rows", "sequences", "steps", "outcome", "speedup", "state")
    return {k: result[k] for k in keys if k in result} or "done"


def run_stage(config: EagleScaleConfig, stage: str, subflow: Any, **params: Any) -> Any:
    """The stage as a subflow, or as its deployment when the config names one; a child run
    that does not complete fails the parent with its state."""
    deployment = config.orchestration.stage_deployments.get(stage)  # type: ignore[call-overload]
    if deployment is None:
        return subflow(config, **params)
    child = run_deployment(
        deployment, parameters={"config": config.model_dump(mode="json"), **params}, timeout=None
    )
    state = child.state
    if state is None or not state.is_completed():
        name = state.name if state else "unknown"
        raise RuntimeError(f"stage {stage}: deployment {deployment!r} run {child.name} ended {name}: {state.message if state else ''}")
    return {"deployment": deployment, "flow_run": child.name, "state": state.name}


def generate_and_extract(
    config: EagleScaleConfig, run: RunFolder, tokenizer: Any, generate: Callable[[], Any]
) -> tuple[Any, Any]:
    """`generate()` here while extraction follows it in a second thread (a subflow of this flow
    run, or its deployment). A generation failure is raised once extraction has stopped (it
    starts no shard after it and commits the one in flight); otherwise both results."""
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
        return run_stage(config, "extract", extract_flow, follow_since=since)

    context = contextvars.copy_context()  # the parent's flow run: extract shows as its subflow
    with ThreadPoolExecutor(1, thread_name_prefix="extract") as pool:
        extracting = pool.submit(context.run, follow)
        try:
            generated = generate()
        finally:
            over.set()  # also where generation failed before its stage clock was written
        return generated, extracting.result()


@flow(name="data-scaling", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def data_scaling(config: EagleScaleConfig) -> dict[str, Any]:
    log = run_logger()
    run = RunFolder(config.run_root, config.storage_options)
    tokenizer = load_tokenizer(config.target.model_path, config.target.chat_template)
    identity = target_identity(config.target.model_path, config.target.revision, tokenizer)
    # Refuse a mismatched resume before any work, on the fields known before discovery.
    check_fingerprint(
        run, run_fingerprint(config, identity, None), config.allow_fingerprint_change, partial=True
    )
    results: dict[str, Any] = {"run_root": config.run_root}
    if "discover" in config.stages:
        results["discover"] = discover_flow(config)
    online = config.train.hidden_states == "online"
    overlap = config.orchestration.overlap and not online and {"generate", "extract"} <= set(config.stages)
    if "generate" in config.stages:
        runner = ThreadPoolTaskRunner(max_workers=config.generate.max_parallel_shards)
        subflow = generate_flow.with_options(task_runner=runner)
        slots = config.orchestration.generate_runs_per_run_root

        def generate() -> Any:
            with run_root_lock(config, "generate", slots=slots) if slots else nullcontext():
                return run_stage(config, "generate", subflow)

        if overlap:
            results["generate"], results["extract"] = generate_and_extract(config, run, tokenizer, generate)
        else:
            results["generate"] = generate()
    if "extract" in config.stages and online:
        # The trainer captures the states itself: nothing to extract, nothing stored.
        results["extract"] = skip_online(config, run)
        log.info("extract: skipped, %s", brief(results["extract"]["forecast"]))
    elif "extract" in config.stages and not overlap:
        results["extract"] = run_stage(config, "extract", extract_flow)
    if "train" in config.stages:
        results["train"] = run_stage(config, "train", train_flow)
    if "gate" in config.stages:
        results["gate"] = run_stage(config, "gate", gate_flow)
    log.info("data-scaling finished: %s", brief({k: _outcome(v) for k, v in results.items()}))
    return results
