"""Small pieces every stage flow shares: the run logger, Slack, Slack hooks for crashes, and the
start/finish skeleton of a stage (`stage_run`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from tasks.config import EagleScaleConfig, SlackConfig
from tasks.notify import Notifier
from tasks.runfolder import RunFolder


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("eaglescale")


def notifier_for(config: EagleScaleConfig) -> Notifier:
    return Notifier.from_config(config.slack, run_label=config.run_root, logger=run_logger())


def _config_from_run(flow_run: Any) -> tuple[SlackConfig, str]:
    params = flow_run.parameters.get("config") or {}
    if isinstance(params, EagleScaleConfig):
        return params.slack, params.run_root
    return SlackConfig.model_validate(params.get("slack") or {}), str(params.get("run_root", "?"))


def slack_on_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow state hook: a failed or crashed stage reaches Slack even if the stage code never did."""
    slack, run_root = _config_from_run(flow_run)
    notifier = Notifier.from_config(slack, run_label=run_root, logger=logging.getLogger("eaglescale"))
    notifier.stage_failed(flow.name, f"{state.type.value}: {state.message or ''}"[:1500])


class StageRun:
    """One stage flow's run: its logger, notifier, run folder and target tokenizer, and the clock
    its completion message reports. `started(fields)` announces the stage; a summary set on
    `summary` is announced as its completion when the `stage_run` block ends without error (a
    failure reaches Slack through the flow's on_failure hook instead)."""

    def __init__(self, config: EagleScaleConfig, name: str) -> None:
        self.config, self.name = config, name
        self.log = run_logger()
        self.notifier = notifier_for(config)
        self.run = RunFolder(config.run_root, config.storage_options)
        self.began = time.time()
        self.summary: dict[str, Any] | None = None

    @cached_property
    def tokenizer(self) -> Any:
        from tasks.target import load_tokenizer

        return load_tokenizer(self.config.target.model_path, self.config.target.chat_template)

    @property
    def elapsed_s(self) -> float:
        return time.time() - self.began

    def started(self, fields: dict[str, Any]) -> None:
        self.notifier.stage_started(self.name, fields)


@contextmanager
def stage_run(config: EagleScaleConfig, name: str) -> Iterator[StageRun]:
    stage = StageRun(config, name)
    yield stage
    if stage.summary is not None:
        stage.notifier.stage_completed(name, stage.summary, stage.elapsed_s)
