"""What the gpunode tests share: the node's folder moved under the test's, the Qwen profile named
by a payload's manifest, a pipeline whose stages run the real CLI, and a generation brought back
as `node wait` brings it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpunode import node_env, plans
from gpunode.pipeline import Pipeline
from gpunode.travel import collect_generation

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "deployments/params/qwen25-coder.yaml"
SMALL_TRAIN = {"max_steps": 4, "eval_every": 4, "save_every": 4, "scaling_fractions": [0.5]}


def on_node(monkeypatch: pytest.MonkeyPatch, node: Path) -> None:
    monkeypatch.setattr(node_env, "NODE", node)  # every module reads it there: the helpers' NODE/params.yaml


def qwen_node(node: Path, plan: str, sets: list[str] | None = None) -> None:
    """A node whose payload was built for the Qwen profile, started with `plan` and `sets`."""
    node.mkdir(parents=True, exist_ok=True)
    (node / "manifest.json").write_text(json.dumps({"parts": [], "profile": str(QWEN.relative_to(REPO))}))
    options = plans.plan_options([], plan, None, plans.parse_settings(sets or []))
    (node / "options.json").write_text(json.dumps(options))


def cli_pipeline(node: Path, monkeypatch: pytest.MonkeyPatch) -> Pipeline:
    """A pipeline on `node` whose stages run `eaglescale run` from this checkout (a rehearsal's
    environment, its Prefect home under the node; its helper steps find the node too)."""
    from tests.run_support import cli_env

    monkeypatch.setattr(node_env, "NODE", node)
    pipeline = Pipeline()
    pipeline.env = {**cli_env(node, OMP_NUM_THREADS="1"), "PYTHONPATH": str(node_env.REPO), "H200_NODE": str(node)}
    return pipeline


def generation_tar(node_out: Path, dest: Path) -> Path:
    """The run's generation as `node wait` brings it back (its parts joined) into `dest`."""
    node_out.mkdir(parents=True, exist_ok=True)
    collect_generation(node_out)
    dest.write_bytes(b"".join(p.read_bytes() for p in sorted(node_out.glob("generation.tar.part-*"))))
    return dest
