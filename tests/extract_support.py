"""Extraction tests' helpers: a generated run on the tiny target (built once per session and
copied per test), and a runner the crash test starts as a subprocess and kills.

    python -m tests.extract_support PARAMS_YAML [PART_BYTES]   runs the extract stage in
    plain code, under shard leases like the flow, printing READY after prepare() and
    <STATUS> <shard> after each shard it ran (COMMITTED, SKIPPED, LEASE_LOST, ...).

    python -m tests.extract_support --fork PARAMS_YAML [PART_BYTES]   the same runner as a
    fork server: its imports (torch, transformers: ~2.5 s of a runner's start on 2 cores) are
    paid once; each stdin line (a failpoint, or "-") forks one runner in its own session,
    which prints PID <pid> first; the server prints EXIT <pid> <code> once it has ended. A
    crash test kills such runners many times at the cost of a fork each.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tasks.config import EagleScaleConfig, load_config
from tasks.extract.storage import shard_metadata
from tasks.runfolder import RunFolder, ShardStore
from tasks.target.tokenizer import load_tokenizer
from tests.run_support import copy_template_run, generate_all, write_params

TOTAL_PROMPTS = 48
SHARD_SIZE = 8
MAX_NEW_TOKENS = 16


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

    def build(template: Path) -> Path:
        generate_all(load_config(_params(template, model_dir, {})))
        return template / "run"

    copy_template_run("extract-template", base, model_dir, dest, build)
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


def fork_server(argv: list[str]) -> int:
    import tasks.extract.stage  # noqa: F401 - the heavy imports, paid once before any fork
    import tasks.runfolder.schedule  # noqa: F401

    # No torch op runs here, and the runners use one thread (OMP_NUM_THREADS=1 from the
    # test): no OpenMP pool exists to be broken by fork().
    print("SERVING", flush=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:  # the runner: its own session, so a kill of its group spares the server
            os.setsid()
            failpoint = line.strip()
            os.environ.pop("EAGLESCALE_FAILPOINT", None)
            if failpoint != "-":
                os.environ["EAGLESCALE_FAILPOINT"] = failpoint
            code = 1
            try:
                print("PID", os.getpid(), flush=True)
                code = main(argv)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("EXIT", pid, os.waitstatus_to_exitcode(status), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fork"]:
        sys.exit(fork_server(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
