"""Small pieces every stage flow shares: the run logger, Slack, Slack hooks for crashes, and the
start/finish skeleton of a stage (`stage_run`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

import tasks.story as story
from tasks.config import EagleScaleConfig, SlackConfig
from tasks.notify import Notifier
from tasks.redaction import redact_text, redact_url
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import CLOCK_HEARTBEAT_S, stage_clock_key
from tasks.runlog import brief, quiet_terminal, run_log


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("eaglescale")


def notifier_for(config: EagleScaleConfig) -> Notifier:
    return Notifier.from_config(config.slack, run_label=config.run_root, logger=run_logger())


def _config_from_run(flow_run: Any) -> tuple[SlackConfig, str]:
    params = flow_run.parameters.get("config") or {}
    run_root = flow_run.parameters.get("run_root")  # data-scaling's own run folder, when given
    if isinstance(params, EagleScaleConfig):
        return params.slack, run_root or params.run_root
    return SlackConfig.model_validate(params.get("slack") or {}), str(run_root or params.get("run_root", "?"))


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
        self.skipped = False  # the stage found its work already done (its clock keeps the run that did it)
        self._clock_lock = threading.Lock()
        self._beating = threading.Event()
        self._heart: threading.Thread | None = None

    @cached_property
    def tokenizer(self) -> Any:
        from tasks.target.tokenizer import load_tokenizer

        return load_tokenizer(self.config.target.model_path, self.config.target.chat_template)

    @property
    def elapsed_s(self) -> float:
        return time.time() - self.began

    def started(self, fields: dict[str, Any]) -> None:
        headline, readable = story.started(self.name, fields)
        self.notifier.stage_started(self.name, readable, headline)

    def clock(self, state: str, prior: dict[str, Any] | None, error: str | None = None) -> None:
        """stages/<name>.json: this attempt's start (and end), the first attempt's start, and
        how many attempts there were; `eaglescale status --json` shows it as stages.<name>."""
        now = time.time()
        record = {
            "stage": self.name, "state": state, "started_at": self.began,
            "ended_at": None if state == "running" else now,
            "first_started_at": (prior or {}).get("first_started_at", self.began),
            "attempts": int((prior or {}).get("attempts", 0)) + 1,
            # While running, rewritten every heartbeat_s: a stage whose process is gone reads
            # as stopped in `eaglescale status`, not as running forever.
            "heartbeat_at": now, "heartbeat_s": CLOCK_HEARTBEAT_S,
        }  # fmt: skip
        if error:  # free text from an exception: a URL's credentials or a known secret never land here
            record["error"] = redact_url(redact_text(error))
        with self._clock_lock:
            self.run.write_json_atomic(stage_clock_key(self.name), record)

    def beat(self, prior: dict[str, Any] | None) -> threading.Thread:
        """Keep the running clock's heartbeat fresh until `stop_beating`."""

        def loop() -> None:
            while not self._beating.wait(CLOCK_HEARTBEAT_S):
                try:
                    self.clock("running", prior)
                except Exception as e:  # a store hiccup: the next beat tries again
                    self.log.warning("%s: stage clock heartbeat failed: %s", self.name, brief(e, 200))

        self._heart = threading.Thread(target=loop, daemon=True, name=f"{self.name}-clock")
        self._heart.start()
        return self._heart

    def stop_beating(self) -> None:
        """End the heartbeat `beat` started, before the clock's last write."""
        self._beating.set()
        if self._heart is not None:
            self._heart.join()


@contextmanager
def stage_run(config: EagleScaleConfig, name: str) -> Iterator[StageRun]:
    quiet_terminal()
    with run_log(config.run_root):
        stage = StageRun(config, name)
        # Temp files a killed write left (a write that failed removes its own).
        stray = stage.run.remove_stray_temps()
        if stray:
            stage.log.info("%s: removed %d temp files left by interrupted writes: %s", name, len(stray), brief(stray, 200))
        prior = stage.run.read_json(stage_clock_key(name))
        stage.clock("running", prior)
        stage.beat(prior)
        try:
            yield stage
        except BaseException as e:
            stage.stop_beating()
            stage.clock("failed", prior, f"{type(e).__name__}: {e}"[:500])
            raise
        stage.stop_beating()
        skipped = stage.skipped or bool((stage.summary or {}).get("skipped"))
        if skipped and prior and prior.get("state") == "completed":
            # A stage that found its work done keeps the times of the run that did it, and
            # announces nothing: it completed in the run that did it.
            stage.run.write_json_atomic(stage_clock_key(name), prior)
            stage.log.info("%s: already done in an earlier run; nothing to do", name)
            return
        stage.clock("completed", prior)
        if stage.summary is not None:
            headline, readable = story.completed(name, stage.summary)
            stage.notifier.stage_completed(name, readable, stage.elapsed_s, headline)
