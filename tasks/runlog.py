"""The run's own log file, and a terminal fit for a 40-hour run.

`run_log(run_root)` appends every log line this process emits (eaglescale's, Prefect's flow and
task runs', the libraries' warnings) to `logs/eaglescale-<UTC start>-<pid>.log` in a local run
folder, so a run's history outlives the terminal that started it; each process of the run (the
CLI, a worker running a stage deployment) writes its own file there. An object store has no
append, so for an `s3://` run root the file is written on the machine itself, under
`<temp dir>/eaglescale-logs/<run root's last part>/`, and its path is logged at the start.

`quiet_terminal()` turns off the weight-loading progress bars of transformers and the hub
(one per model load, each redrawn many times: noise in a terminal and in a log file).
`brief(obj)` keeps a logged value to one readable line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from tasks.redaction import redact_text, redact_url

LOG_DIR = "logs"
FORMAT = "%(asctime)s %(levelname)-7s %(process)d %(name)s: %(message)s"
# Loggers of our own code: their INFO lines go to the file; the terminal keeps showing only
# their warnings, as before the file existed.
OWN_LOGGERS = ("tasks", "eaglescale")
BRIEF_CHARS = 400
FILE_ONLY = "file_only"  # log(..., extra={FILE_ONLY: True}): the file gets it, the terminal not

_started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def brief(value: Any, limit: int = BRIEF_CHARS) -> str:
    """`value` as text cut to `limit` characters (a summary dict can run to kilobytes)."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} chars more)"


class _Redacting(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact_url(redact_text(record.getMessage())), None
        return True


def log_file_path(run_root: str) -> str:
    """Where this process's log file of the run at `run_root` goes (see the module's text)."""
    name = f"eaglescale-{_started}-{os.getpid()}.log"
    if "://" in run_root and not run_root.startswith("file://"):
        tail = run_root.rstrip("/").rsplit("/", 1)[-1] or "run"
        return os.path.join(tempfile.gettempdir(), "eaglescale-logs", tail, name)
    root = run_root.removeprefix("file://")
    return os.path.join(root, LOG_DIR, name)


@contextlib.contextmanager
def run_log(run_root: str) -> Iterator[str]:
    """Append this process's log lines to its log file of the run while inside; a second
    `run_log` of the same run in the same process adds nothing. Yields the file's path."""
    path = os.path.abspath(log_file_path(run_root))
    root = logging.getLogger()
    if any(getattr(h, "baseFilename", None) == path for h in root.handlers):
        yield path
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_Redacting())
    handler.setLevel(logging.INFO)
    # Our loggers' INFO lines reach the file only: their own handlers, warnings to stderr.
    own: list[tuple[logging.Logger, int, bool, logging.Handler]] = []
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setLevel(logging.WARNING)
        stderr.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        stderr.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
        own.append((logger, logger.level, logger.propagate, stderr))
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(handler)
        logger.addHandler(stderr)
    # The root keeps its level: libraries' warnings reach the file, their INFO chatter (an
    # HTTP line per API call) does not; Prefect's run loggers set their own level (INFO).
    root.addHandler(handler)
    logging.getLogger("eaglescale").info("log file of this process: %s", path)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        for logger, level, propagate, stderr in own:
            logger.removeHandler(handler)
            logger.removeHandler(stderr)
            logger.setLevel(level)
            logger.propagate = propagate
        handler.close()


def quiet_terminal() -> None:
    """No progress bars for weight loading: before transformers is imported (the variable),
    and after (its switch), in this process and the ones it starts."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
