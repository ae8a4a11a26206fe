"""Stage flow `train`: the EAGLE-3 draft on the extracted hidden states, then its export.

One process by default; with `train.nproc > 1` the same trainer runs under torchrun (DDP), and
this flow waits for it. Either way the run folder holds the checkpoints, train/best.json and
train/result.json, and the best checkpoint is exported to train/final (SGLang's EAGLE3 format)
and train/final-speculators (vLLM's speculators format). With `train.scaling_fractions` the same
training then runs on those fractions of the data (train/scaling/, for the gate's curve).
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

from flows.common import StageRun, slack_on_failure, stage_run
from flows.concurrency import gpu_slots, gpus_needed
from tasks.config import EagleScaleConfig
from tasks.draft.export import export_run_draft
from tasks.draft.online import OnlineTarget
from tasks.draft.scaling_drafts import scaling_drafts, train_scaling_drafts
from tasks.draft.trainer import TrainCallbacks, train_draft
from tasks.runfolder.layout import TRAIN_PLOT, TRAIN_RESULT

EVAL_COLUMNS = ("step", "loss", "sim_accept", "sim_accept_len", "acc_0", "acc_1", "acc_2", "acc_3")


def _torchrun(config: EagleScaleConfig) -> None:
    """The trainer under torchrun; the params travel as a YAML file of this flow's config."""
    with tempfile.TemporaryDirectory() as tmp:
        params = Path(tmp) / "params.yaml"
        params.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(config.train.nproc), "-m", "tasks.draft.train_main",
            "--params", str(params),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun trainer exited {done.returncode}: {done.stderr[-2000:]}")


def _eval_table(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: e[k] for k in EVAL_COLUMNS if k in e} for e in evals]


@flow(name="train", on_failure=[slack_on_failure], on_crashed=[slack_on_failure])
def train_flow(config: EagleScaleConfig) -> dict[str, Any]:
    with stage_run(config, "train") as span:
        return _train(config, span)


def _train(config: EagleScaleConfig, span: StageRun) -> dict[str, Any]:
    log, run = span.log, span.run
    before = (run.read_json(TRAIN_RESULT), [d["samples"] for d in scaling_drafts(run)])
    span.started({"nproc": config.train.nproc, "device": config.train.device,
                  "hidden_states": config.train.hidden_states})
    with gpu_slots(config, gpus_needed(config, "train")):
        if config.train.nproc > 1:
            _torchrun(config)
        else:
            callbacks = TrainCallbacks(on_eval=lambda e: log.info("eval: %s", {k: e.get(k) for k in EVAL_COLUMNS}))
            online = OnlineTarget.from_config(config)  # None unless train.hidden_states is online
            train_draft(run, config.train, config.target.model_path, callbacks=callbacks, online=online)
            if config.train.scaling_fractions:  # the data-scaling drafts the gate measures
                train_scaling_drafts(run, config.train, config.target.model_path, callbacks=callbacks,
                                     online=online)
    result = run.read_json(TRAIN_RESULT) or {}
    exported = export_run_draft(run, config.target.model_path)
    evals = result.get("evals", [])
    if evals:
        create_table_artifact(_eval_table(evals), key="train-evals", description="Held-out metrics per eval")
    if run.exists(TRAIN_PLOT):
        png = base64.b64encode(run.read_bytes(TRAIN_PLOT)).decode()
        create_markdown_artifact(
            f"# Per-position accuracy\n\n![accuracy](data:image/png;base64,{png})",
            key="train-accuracy",
            description="Held-out per-position accuracy over training",
        )
    best = exported["best"]
    summary = {
        "steps": result.get("steps"),
        "best_step": best.get("step"),
        "best_sim_accept_len": best.get("sim_accept_len"),
        "final": exported["final"],
        "scaling_drafts": [d["samples"] for d in scaling_drafts(run)],
    }
    # A resume that found training at its last step and every scaling draft exported trained
    # nothing: the stage keeps the clock of the run that did.
    prior = before[0] or {}
    span.skipped = (
        result.get("resumed_from") is not None
        and prior.get("steps") == result.get("steps")
        and before[1] == summary["scaling_drafts"]
        and len(before[1]) == len(config.train.scaling_fractions)
    )
    span.summary = summary
    return summary
