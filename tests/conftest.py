"""Shared fixtures: the tiny local target, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built tiny target model folder (seed 0, the shipped sample prompts)."""
    from tasks.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_target") / "model")
