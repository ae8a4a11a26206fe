"""Extraction tests' helpers: a generated run on the tiny target (built once per session and
copied per test), and a runner the crash test starts as a subprocess and kills.

    python -m tests.extract_support PARAMS_YAML [PART_BYTES]   runs the extract stage in
    plain code, under shard leases like the flow, printing READY after prepare() and
    <STATUS> <shard> after each shard it ran (COMMITTED, SKIPPED, LEASE_LOST, ...).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tasks.config import EagleScaleConfig, load_config
from tasks.extract.storage import shard_metadata
from tasks.runfolder import RunFolder, ShardStore
from tasks.target import load_tokenizer
from tests.run_support import generate_all, write_params

TOTAL_PROMPTS = 48
SHARD_SIZE = 8
MAX_NEW_TOKENS = 16
_templates: dict[str, Path] = {}


def _params(dest: Path, model_dir: Path, extract: dict[str, Any]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    return write_params(
        dest,
        model_dir,
        str(dest / "run"),
        sampling={"max_new_tokens": MAX_NEW_TOKENS},
        engine={"kind": "local", "batch_size": 16},
        generate={"shard_size": SHARD_SIZE},
        discover={"total_prompts": TOTAL_PROMPTS},
        extract={"batch_size": 4, "max_length": 256, "eval_fraction": 0.25, **extract},
    )


def generated_run(
    base: Path, model_dir: Path, dest: Path, **extract: Any
) -> tuple[EagleScaleConfig, Path]:
    """A run under `dest` whose discover and generate stages are committed (a copy of one
    generated once per session under `base`), with `extract` overriding extract params."""
    if "run" not in _templates:
        template = base / "extract-template"
        generate_all(load_config(_params(template, model_dir, {})))
        _templates["run"] = template / "run"
    shutil.copytree(_templates["run"], dest / "run")
    params = _params(dest, model_dir, extract)
    return load_config(params), params


def extracted_ids(run: RunFolder) -> tuple[list[str], list[str]]:
    """Sequence ids of committed extract shards (all parts) and of their dead letters, in
    shard order."""
    store = ShardStore(run, "extract")
    rows: list[str] = []
    dead: list[str] = []
    for _, marker in sorted(store.committed().items()):
        for data in store.iter_parts(marker):
            rows += shard_metadata(data)["sequence_ids"]
        dead += store.read_dead(marker).column("request_id").to_pylist()
    return rows, dead


def main(argv: list[str]) -> int:
    from tasks.extract.stage import ExtractStage
    from tasks.runfolder.schedule import ShardScheduler, run_one_at_a_time

    cfg = load_config(argv[0])
    run = RunFolder(cfg.run_root)
    part_bytes = int(argv[1]) if len(argv) > 1 else None
    stage = ExtractStage(cfg, run, load_tokenizer(cfg.target.model_path), part_bytes=part_bytes)
    pending = stage.prepare()
    print("READY", len(pending), flush=True)

    def run_one(shard_id: str) -> dict[str, Any]:
        outcome = asdict(stage.run_shard(shard_id))
        print(outcome["status"].upper(), shard_id, flush=True)
        return outcome

    scheduler = ShardScheduler(stage, pending, max_running=1)
    failures = run_one_at_a_time(scheduler, run_one, min(1.0, cfg.extract.lease_heartbeat_s))
    summary = stage.finish()
    stage.close()
    print("COMPLETE" if summary["complete"] else "INCOMPLETE", flush=True)
    if failures:
        print(f"FAILED {failures}", file=sys.stderr, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
