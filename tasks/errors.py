"""The base of the failures `eaglescale` reports as a message alone. A module that imports
nothing, so every layer (the run folder and SGLang's knowledge at the bottom included) may
derive from it without an upward arrow (tests/test_layering.py)."""

from __future__ import annotations


class ExpectedFailure(Exception):
    """A failure whose message names the problem and the fix: the CLI prints the message and
    exits non-zero, without a traceback (which would bury the message). Anything else is a bug
    or an unforeseen condition, and keeps its traceback (flows/cli.py::is_expected).

    A subclass keeps its own built-in base first (`class X(RuntimeError, ExpectedFailure)`),
    so every `except RuntimeError` that caught it before still does."""
