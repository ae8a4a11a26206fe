"""Helpers for end-to-end tests: params for a run in tmp_path, and exactly-once checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tasks.config import EagleScaleConfig
from tasks.discover.commit import read_prompts_table
from tasks.discover.stage import run_discover_stage
from tasks.engines.local import LocalEngine
from tasks.generate.plan import planned_requests
from tasks.generate.stage import GenerateStage, generation_fingerprint
from tasks.runfolder import RunFolder, ShardStore
from tasks.target import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def write_params(tmp_path: Path, model_dir: Path, run_root: str, **sections: dict[str, Any]) -> Path:
    """The smoke profile with absolute paths, a given run root and section overrides."""
    params = yaml.safe_load((ROOT / "deployments/params/smoke.yaml").read_text())
    params["run_root"] = run_root
    params["target"]["model_path"] = str(model_dir)
    params["gate"]["registry_url"] = str(tmp_path / "registry")  # never the checkout's
    for source in params["discover"]["sources"]:  # relative to the profile's folder
        source["path"] = os.path.normpath(ROOT / "deployments/params" / source["path"])
    for name, values in sections.items():
        if isinstance(params.get(name), dict):
            params[name].update(values)
        else:
            params[name] = values
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


# The host's Slack, AWS and Prefect settings as pytest found them: never handed to a child (a
# developer's real Slack token, AWS profile or Prefect API must not reach a test's run). What a
# test's own fixtures set later (moto's credentials, a test token) is passed on.
CHILD_ENV_PREFIXES = ("SLACK_", "AWS_", "PREFECT_")
HOST_ENV = {k: v for k, v in os.environ.items() if k.startswith(CHILD_ENV_PREFIXES)}


def clean_child_env(environ: dict[str, str], host: dict[str, str]) -> dict[str, str]:
    """`environ` without the host's own SLACK_*/AWS_*/PREFECT_* values (same key, same value)."""
    return {k: v for k, v in environ.items() if not (k in host and host[k] == v)}


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = clean_child_env(dict(os.environ), HOST_ENV)
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
        # A fresh Prefect home migrates its database first (~25 s on a 2-core box).
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        HF_HUB_OFFLINE="1",
    )
    env.pop("PREFECT_API_URL", None)
    env.update(extra)
    return env


def start_cli(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """`eaglescale ...` in its own process group, so a test can kill -9 all of it at once."""
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def planned_ids(run: RunFolder) -> set[str]:
    fp_hash = run.read_json("run.json")["fingerprint_hash"]
    samples = run.read_json("run.json")["fingerprint"]["sampling"]["samples_per_prompt"]
    prompt_ids = read_prompts_table(run, "manifest").column("prompt_id").to_pylist()
    return {p.request_id for p in planned_requests(prompt_ids, fp_hash, samples)}


def committed_ids(run: RunFolder, stage: str = "generate") -> tuple[list[str], list[str]]:
    """Request ids of committed rows and of dead letters, as lists (duplicates would show)."""
    store = ShardStore(run, stage)
    rows: list[str] = []
    dead: list[str] = []
    for marker in store.committed().values():
        rows += store.read_rows(marker).column("request_id").to_pylist()
        dead += store.read_dead(marker).column("request_id").to_pylist()
    return rows, dead


def assert_exactly_once(run: RunFolder) -> tuple[int, int]:
    rows, dead = committed_ids(run)
    planned = planned_ids(run)
    assert len(rows) == len(set(rows)), "a request id was committed twice"
    assert not set(rows) & set(dead), "a request is both committed and dead"
    assert set(rows) == planned - set(dead), (
        f"committed keys differ from planned - dead: missing {len(planned - set(dead) - set(rows))}, "
        f"extra {len(set(rows) - planned)}"
    )
    return len(rows), len(dead)


def discover_and_fingerprint(cfg: EagleScaleConfig) -> tuple[RunFolder, Any, str]:
    """Plain-code start of a run (what the parent flow does): discovery, then run.json."""
    run = RunFolder(cfg.run_root, cfg.storage_options)
    tokenizer = load_tokenizer(cfg.target.model_path)
    run_discover_stage(cfg, run, tokenizer)
    return run, tokenizer, generation_fingerprint(cfg, run, tokenizer)


def generate_all(cfg: EagleScaleConfig, batch_size: int = 16) -> None:
    """Discovery and every generation shard, in plain code, with the local engine."""
    run, tokenizer, fp_hash = discover_and_fingerprint(cfg)
    engine = LocalEngine(cfg.target.model_path, batch_size=batch_size)
    stage = GenerateStage(cfg, run, fp_hash, engine, tokenizer)
    for shard_id in stage.prepare():
        stage.run_shard(shard_id)
    stage.finish()
    engine.close()
