"""Crash-test hook for the commit protocol's exact points."""

from __future__ import annotations

import os
import signal

_failpoint_hits: dict[str, int] = {}


def failpoint(name: str) -> None:
    """EAGLESCALE_FAILPOINT=name[:n] SIGKILLs this process group at the n-th hit of `name`.

    Lets the crash tests kill a run at exact points of the commit protocol (a timer cannot).
    """
    spec = os.environ.get("EAGLESCALE_FAILPOINT")
    if not spec:
        return
    wanted, _, nth = spec.partition(":")
    if wanted != name:
        return
    _failpoint_hits[name] = _failpoint_hits.get(name, 0) + 1
    if _failpoint_hits[name] >= int(nth or 1):
        os.killpg(os.getpgrp(), signal.SIGKILL)
