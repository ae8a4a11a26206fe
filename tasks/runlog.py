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
# their warnings, as before the file existed (unless a user configured them otherwise).
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
    # Our loggers' INFO lines, which the root's WARNING level drops, are let through for the
    # file; the terminal's handlers keep showing only their warnings, as before. Loggers a
    # user set up (PREFECT_LOGGING_EXTRA_LOGGERS, a DEBUG root) are left as they are.
    raised = [logging.getLogger(n) for n in OWN_LOGGERS if logging.getLogger(n).getEffectiveLevel() > logging.INFO]
    for logger in raised:
        logger.setLevel(logging.INFO)
    terminal = _WarningsOnlyFrom(tuple(lg.name for lg in raised))
    others = list(root.handlers)
    for h in others:
        h.addFilter(terminal)
    root.addHandler(handler)
    logging.getLogger("eaglescale").info("log file of this process: %s", path)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        for h in others:
            h.removeFilter(terminal)
        for logger in raised:
            logger.setLevel(logging.NOTSET)
        handler.close()


class _WarningsOnlyFrom(logging.Filter):
    """On a terminal's handler: drops the INFO lines of loggers raised to INFO for the file."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, FILE_ONLY, False):
            return False
        return record.levelno >= logging.WARNING or not record.name.startswith(self.names)


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
