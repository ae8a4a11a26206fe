"""Helpers for end-to-end tests: params for a run in tmp_path, and exactly-once checks."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tasks.config import EagleScaleConfig
from tasks.discover.commit import read_prompts_table
from tasks.engines.local import LocalEngine
from tasks.generate.plan import planned_requests
from tasks.generate.stage import GenerateStage, generation_fingerprint
from tasks.runfolder import RunFolder, ShardStore
from tasks.runfolder.parts import marker_paths
from tasks.synthesize.stage import discover_with_synthesis
from tasks.target.tokenizer import load_tokenizer

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


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child, less the host's SLACK_*/AWS_*/PREFECT_* values
    (make test's own PREFECT_SERVER_* settings included: callers set what they need), no
    Prefect analytics, plus `extra`."""
    env = clean_child_env(dict(os.environ), HOST_ENV)
    return {**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


def cli_env(tmp_path: Path, fresh_prefect_home: bool = False, **extra: str) -> dict[str, str]:
    """The environment of an `eaglescale` child: its Prefect home under `tmp_path`. Without
    PREFECT_API_URL the run starts its temporary API on that home, whose database is a copy of
    one already migrated (`migrated_prefect_home`) unless `fresh_prefect_home`: then it migrates
    its own first, as a user's first run does."""
    env = child_env()
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
    if not fresh_prefect_home and not env.get("PREFECT_API_URL"):
        migrated_prefect_home(Path(env["PREFECT_HOME"]))
    return env


# Where the session's migrated Prefect database is built (tests/conftest.py sets it: one folder
# for every xdist worker of the session).
PREFECT_TEMPLATE_ENV = "EAGLESCALE_TEST_PREFECT_TEMPLATE"


def migrated_prefect_home(home: Path) -> Path:
    """`home`, holding a copy of a Prefect database this Prefect has migrated to its head (built
    once per test session by `prefect server database upgrade`, shared by the workers under a
    file lock). A fresh home's migration costs every temporary API or `prefect server start`
    ~20-30 s of a 2-core box and is none of what the tests check; tests/test_cli_run.py keeps a
    first run's fresh home. A home that has a database keeps it; outside a test session (no
    template folder set) `home` is left as it is."""
    db = home / "prefect.db"
    if db.exists() or not os.environ.get(PREFECT_TEMPLATE_ENV):
        return home
    template = Path(os.environ[PREFECT_TEMPLATE_ENV])
    from filelock import FileLock

    with FileLock(f"{template}.lock"):
        if not (template / "prefect.db").exists():
            building = template.with_name(f"{template.name}.building")
            shutil.rmtree(building, ignore_errors=True)
            upgrade = [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"]
            done = subprocess.run(upgrade, env=child_env(PREFECT_HOME=str(building)), capture_output=True, text=True, timeout=300)
            assert done.returncode == 0 and (building / "prefect.db").is_file(), done.stdout[-2000:] + done.stderr[-2000:]
            building.rename(template)
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template / "prefect.db", db)
    return home


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


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def kill_at_progress(
    proc: subprocess.Popen,
    progress: Callable[[], int],
    first_at: int,
    pause_s: float,
    cap_at: int,
    limit_s: float = 300.0,
    poll_s: float = 0.02,
) -> bool:
    """kill -9 `proc`'s group once `progress()` reaches `first_at`, after a pause of `pause_s`
    cut short when it reaches `cap_at`: a moment set by the work done, with a time component
    bounded in work, so the number of kills a run of fixed size takes never depends on the
    machine's speed. True when this killed it; False when `proc` had ended first."""
    deadline = time.monotonic() + limit_s
    pause_until: float | None = None
    while proc.poll() is None:
        done = progress()
        if pause_until is None and done >= first_at:
            pause_until = time.monotonic() + pause_s
        if pause_until is not None and (time.monotonic() >= pause_until or done >= cap_at):
            kill_group(proc)
            return True
        assert time.monotonic() < deadline, f"no progress in {limit_s} s ({done} of {first_at})"
        time.sleep(poll_s)
    return False


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


def rows_by_request(run: RunFolder, stage: str = "generate") -> dict[str, dict[str, Any]]:
    """Every committed row of a stage, by request id."""
    store = ShardStore(run, stage)
    return {
        row["request_id"]: row
        for marker in store.committed().values()
        for row in store.read_rows(marker).to_pylist()
    }


def unmarked_objects(run: RunFolder, stage: str) -> set[str]:
    """Objects under <stage>/data and <stage>/dead that no marker names: what a kill between
    a commit's first write and its marker leaves behind."""
    named = {path for marker in ShardStore(run, stage).committed().values() for path in marker_paths(marker)}
    present = {f"{stage}/{sub}/{name}" for sub in ("data", "dead") for name in run.listdir(f"{stage}/{sub}")}
    return present - named


def left_mid_commit(run: RunFolder, stage: str, pid: int) -> set[str]:
    """Objects a commit of the process `pid` wrote without its marker (attempt ids carry the
    writer's pid): the proof that a kill of `pid` landed inside the commit sequence."""
    return {rel for rel in unmarked_objects(run, stage) if f"-{pid}-" in rel.rsplit("/", 1)[1]}


def marked_unreleased(run: RunFolder, stage: str, pid: int) -> list[str]:
    """Shards committed by `pid` whose lease it still held: it died after a marker and before
    the lease release that follows it."""
    names = run.listdir(f"{stage}/leases")
    out = []
    for shard, marker in ShardStore(run, stage).committed().items():
        if f"-{pid}-" not in marker["attempt"]:
            continue
        mine = [n for n in names if n.startswith(f"{shard}.") and n.endswith(".json")]
        last = max((run.read_json(f"{stage}/leases/{n}") for n in mine), key=lambda r: r["epoch"])
        if last["holder"]["pid"] == pid and not last.get("released"):
            out.append(shard)
    return out


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


# Template runs built once per session, keyed by what they are built from: the builder (its
# name; its other inputs are constants) and the target. Keyed by the builder alone, a test on
# another target would get a run generated by the first one. Where a template lies (the first
# caller's base folder) is no input.
_templates: dict[tuple[str, str], Path] = {}


def copy_template_run(
    name: str, base: Path, model_dir: Path, dest: Path, build: Callable[[Path], Path]
) -> None:
    """Copy to `dest`/run the run `build(folder)` makes for the target `model_dir` (it
    returns the run's folder), built on first use under `base`."""
    key = (name, str(Path(model_dir).resolve()))
    if key not in _templates:
        _templates[key] = build(base / f"{name}-{len(_templates)}")
    shutil.copytree(_templates[key], dest / "run")


def discover_and_fingerprint(cfg: EagleScaleConfig) -> tuple[RunFolder, Any, str]:
    """Plain-code start of a run (what the parent flow does): discovery, then run.json."""
    run = RunFolder(cfg.run_root, cfg.storage_options)
    tokenizer = load_tokenizer(cfg.target.model_path)
    discover_with_synthesis(cfg, run, tokenizer)
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


def small_profile(profile: Path, tmp_path: Path, *, model_path: str | None = None, max_prompt_tokens: int = 256,
                  max_length: int = 384, batch_tokens: int = 1024) -> Path:  # fmt: skip
    """A real-data profile (ShareGPT + HumanEval sources) cut to a CPU run in tmp_path: 10 prompts,
    6 new tokens, local engine, a 3-step draft; written beside and returned. `model_path`
    replaces the target; the sizes follow its context (a Qwen2 chat template is longer)."""
    params = yaml.safe_load(profile.read_text())
    params["run_root"] = str(tmp_path / "run")
    if model_path is not None:
        params["target"]["model_path"] = model_path
    params["stages"] = ["discover", "generate", "extract", "train"]
    sharegpt, humaneval = params["discover"]["sources"]
    sharegpt["max_rows"], humaneval["max_rows"] = 60, 10
    params["discover"].update(holdout_per_domain=1, total_prompts=10, domain_quotas={}, max_prompt_tokens=max_prompt_tokens)
    params["sampling"]["max_new_tokens"] = 6
    params["engine"] = {"kind": "local", "device": "cpu", "dtype": "float32", "batch_size": 10}
    params["generate"].update(shard_size=5, max_parallel_shards=1)
    params["extract"].update(device="cpu", dtype="float32", batch_size=4, max_length=max_length, eval_fraction=0.2)
    params["train"].update(device="cpu", compute_dtype="float32", draft_vocab_size=512, ttt_steps=2,
                           epochs=1, max_steps=3, batch_tokens=batch_tokens, eval_every=3, save_every=3,
                           warmup_steps=1, scaling_fractions=[])  # fmt: skip
    params["gate"]["registry_url"] = str(tmp_path / "registry")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path
