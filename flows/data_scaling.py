"""The parent flow `data-scaling`: the whole DAG, one subflow per stage.

discover -> generate -> extract -> train; the gate and promotion join as the next stages.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.common import run_logger, slack_on_failure
from flows.discover import discover_flow
from flows.extract import extract_flow
from flows.generate import generate_flow
from flows.train import train_flow
from tasks.config import EagleScaleConfig
from tasks.discover.commit import discovery_marker
from tasks.fingerprint_fields import run_fingerprint
from tasks.runfolder import RunFolder, check_fingerprint, ensure_fingerprint
from tasks.target import load_tokenizer, target_identity


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
    if "generate" in config.stages:
        marker = discovery_marker(run)
        if marker is None:
            raise RuntimeError(f"{run.url}: no committed prompts/; run the discover stage first")
        fp = run_fingerprint(config, identity, marker["manifest_hash"])
        fp_hash = ensure_fingerprint(run, fp, config.allow_fingerprint_change)
        runner = ThreadPoolTaskRunner(max_workers=config.generate.max_parallel_shards)
        results["generate"] = generate_flow.with_options(task_runner=runner)(config, fp_hash)
    if "extract" in config.stages:
        results["extract"] = extract_flow(config)
    if "train" in config.stages:
        results["train"] = train_flow(config)
    log.info("data-scaling finished: %s", results)
    return results
