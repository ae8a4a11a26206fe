"""Stage flow `train`: the EAGLE-3 draft on the extracted hidden states, then its export.

The work is tasks.train.stage.run_train_stage; this flow holds the GPU slots while it trains,
logs each evaluation, and shows the held-out metrics and the accuracy plot as artifacts.
One process by default; with `train.nproc > 1` the same training runs under torchrun (DDP,
`python -m tasks.train.main` per rank), and the stage exports once it has returned. Either way
the run folder holds the checkpoints, train/best.json and train/result.json, and the best
checkpoint is exported to train/final (SGLang's EAGLE3 format) and train/final-speculators
(vLLM's speculators format). With `train.scaling_fractions` the same training then runs on those
fractions of the data (train/scaling/, for the gate's curve). When train.time_budget_s stops
training at a checkpoint, nothing is exported and the flow fails with a TrainError that says so:
the next run resumes it.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

import tasks.humanize as humanize
from flows.common import StageRun, slack_on_failure, stage_run
from flows.concurrency import gpu_slots, gpus_needed
from tasks.config import EagleScaleConfig
from tasks.draft.scaling_drafts import scaling_drafts
from tasks.draft.trainer import TrainCallbacks, TrainError
from tasks.runfolder.layout import TRAIN_PLOT, TRAIN_RESULT
from tasks.train.stage import run_train_stage

# The held-out metrics per eval in the UI's table and the log: pooled_accept_len_3 is the accept
# length at 3 drafts counted as SGLang counts it (tasks/draft/acceptance.py); target_agreement the
# share of response tokens that are the target's argmax (train.min_target_agreement); the gradient
# norm, clip rate, step time and wait for the batch are the training window's since the eval before.
EVAL_COLUMNS = ("step", "loss", "sim_accept", "sim_accept_len", "pooled_accept_len_3", "target_agreement", "acc_0",
                "acc_1", "acc_2", "acc_3", "train_grad_norm", "train_clip_rate", "train_step_s",
                "train_data_wait_s")  # fmt: skip


def _torchrun(config: EagleScaleConfig) -> None:
    """The trainer under torchrun; the params travel as a YAML file of this flow's config."""
    with tempfile.TemporaryDirectory() as tmp:
        params = Path(tmp) / "params.yaml"
        params.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(config.train.nproc), "-m", "tasks.train.main",
            "--params", str(params),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun trainer exited {done.returncode}: {done.stderr[-2000:]}")


def _eval_table(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evals as people read them (4 significant digits, step times in ms); train/result.json
    keeps every digit."""
    return [{k: humanize.value(e[k], k) for k in EVAL_COLUMNS if k in e} for e in evals]


@flow(name="train", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def train_flow(config: EagleScaleConfig) -> dict[str, Any]:
    with stage_run(config, "train") as span:
        return _train(config, span)


def _train(config: EagleScaleConfig, span: StageRun) -> dict[str, Any]:
    log, run = span.log, span.run
    before = (run.read_json(TRAIN_RESULT), [d["samples"] for d in scaling_drafts(run)])
    span.started({"nproc": config.train.nproc, "device": config.train.device,
                  "hidden_states": config.train.hidden_states})
    callbacks = TrainCallbacks(on_eval=lambda e: log.info("eval: %s", ", ".join(
        f"{k} {humanize.value(e[k], k)}" for k in EVAL_COLUMNS if e.get(k) is not None)))  # fmt: skip
    outcome = run_train_stage(config, callbacks, train=_torchrun if config.train.nproc > 1 else None,
                              hold=gpu_slots(config, gpus_needed(config, "train")))  # fmt: skip
    evals = outcome.result.get("evals", [])
    if evals:
        create_table_artifact(_eval_table(evals), key="train-evals", description="Held-out metrics per eval")
    if run.exists(TRAIN_PLOT):
        png = base64.b64encode(run.read_bytes(TRAIN_PLOT)).decode()
        create_markdown_artifact(
            f"# Per-position accuracy\n\n![accuracy](data:image/png;base64,{png})",
            key="train-accuracy",
            description="Held-out per-position accuracy over training",
        )
    stopped = outcome.summary.get("stopped_for_budget")
    if stopped:  # not done: nothing exported, so the gate has no draft to measure yet
        where = outcome.summary["last_checkpoint"] if stopped == "train" else stopped
        raise TrainError(f"{run.url}/{where}: training stopped there for train.time_budget_s "
                         f"({config.train.time_budget_s} s), before its last step; nothing is exported "
                         "until it finishes: run again to resume it")  # fmt: skip
    # A resume that found training at its last step and every scaling draft exported trained
    # nothing: the stage keeps the clock of the run that did.
    prior = before[0] or {}
    span.skipped = (
        outcome.result.get("resumed_from") is not None
        and prior.get("steps") == outcome.result.get("steps")
        and before[1] == outcome.summary["scaling_drafts"]
        and len(before[1]) == len(config.train.scaling_fractions)
    )
    span.summary = outcome.summary
    return outcome.summary
