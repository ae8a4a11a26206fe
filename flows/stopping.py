"""How `eaglescale run` stops on SIGINT or SIGTERM: within seconds, cleanly, leaving nothing.

A signal raises RunStopped in the main thread, wherever the run is. The stage flows turn that
into a stop of their work: generation drops its engine's requests, so every shard journals what
it has and ends unretried (flows/generate.py), and releases its leases; Prefect records the
flow runs as crashed (its API is still up: flows/temporary_api.py). The CLI then ends what it
started (the temporary API, any child process left) and prints one line naming the resume
command, with exit code 128 + the signal (130 for SIGINT, 143 for SIGTERM).

While a flow runs, Prefect's own SIGTERM handler comes first: it raises TerminationSignal, and
once the flow runs are reported it restores this handler and sends SIGTERM again, which then
raises RunStopped here. A second signal during the stop exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any


class RunStopped(KeyboardInterrupt):
    """The run was told to stop (SIGINT or SIGTERM). A KeyboardInterrupt, so that no `except
    Exception` swallows it and Prefect records the flow run as crashed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    if _received:  # a second signal: the operator wants out now
        os._exit(128 + _received[0])
    _received.append(signum)
    raise RunStopped(signum)


def install() -> dict[int, Any]:
    """SIGINT and SIGTERM raise RunStopped in the main thread from now on; returns the handlers
    they replace (for `restore`)."""
    _received.clear()
    return {signum: signal.signal(signum, _on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}


def restore(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def stop_signal(exc: BaseException) -> int | None:
    """The signal that stopped the run, when `exc` is how a stop surfaced (RunStopped, Prefect's
    TerminationSignal, a KeyboardInterrupt); None for any other failure."""
    if isinstance(exc, RunStopped):
        return exc.signum
    if _received:
        return _received[0]
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    signum = getattr(exc, "signal", None)  # prefect.exceptions.TerminationSignal
    return signum if type(exc).__name__ == "TerminationSignal" and isinstance(signum, int) else None


def is_stop(exc: BaseException) -> bool:
    return stop_signal(exc) is not None


def _children(pid: int) -> list[int]:
    """The living descendants of `pid`, from /proc (none where there is no /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[-1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def end_children(grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process this one started and that still runs (a server, a trainer), then
    SIGKILL what is left after `grace_s`. Returns the pids it signalled."""
    pids = _children(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return pids


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return False  # reaped here: it was our child and has ended
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stopped_message(signum: int, resume: list[str]) -> str:
    import shlex

    return f"eaglescale: stopped by {signal.Signals(signum).name}; resume with: {shlex.join(resume)}"


def exit_code(signum: int) -> int:
    return 128 + signum
