"""Small pieces every stage flow shares: the run logger, Slack, and Slack hooks for crashes."""

from __future__ import annotations

import logging
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from tasks.config import EagleScaleConfig, SlackConfig
from tasks.notify import Notifier


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
