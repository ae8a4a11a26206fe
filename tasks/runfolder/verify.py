"""`eaglescale verify RUN_ROOT`: every byte a run folder vouches for, checked on demand.

A resume checks what it skips cheaply (tasks/runfolder/shards.py::ShardStore.damaged: sizes,
and generation's sha256s); this reads everything: each JSON record the run keeps, every
object each shard marker names (size and sha256), the prompt tables against discovery's
marker, each checkpoint's files against its meta.json, and the exported drafts' safetensors
headers against their sizes. Each problem is printed with the file and the fix.

Exit codes: 0 nothing wrong, 1 problems found, 2 no run folder there.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import dataclass
from typing import Any

import fsspec

from tasks.runfolder.folder import TMP_PREFIX, RunFolder
from tasks.runfolder.layout import (
    DISCOVERY_MARKER,
    GATE_DONE,
    SHARD_PLAN,
    STAGE_CLOCKS,
    SYNTHESIS_PLAN,
    SYNTHESIS_STAGE,
    TRAIN_BEST,
    TRAIN_CHECKPOINTS,
    TRAIN_DATA,
    TRAIN_FINAL,
    TRAIN_FINAL_SPECULATORS,
    TRAIN_RESULT,
)
from tasks.runfolder.shards import ShardStore, redo_hint, sha256_hex

EXIT_OK, EXIT_PROBLEMS, EXIT_MISSING = 0, 1, 2
SHARD_STAGES = (SYNTHESIS_STAGE, "generate", "extract")
# JSON files a stage writes whole and reads back (a torn one fails the reader).
RECORDS = ("run.json", SHARD_PLAN, SYNTHESIS_PLAN, TRAIN_BEST, TRAIN_DATA, TRAIN_RESULT, GATE_DONE)


@dataclass(frozen=True)
class Problem:
    path: str  # run-relative key
    what: str
    fix: str


def _json(run: RunFolder, rel: str, fix: str, problems: list[Problem]) -> Any | None:
    try:
        return json.loads(run.read_bytes(rel))
    except FileNotFoundError:
        return None
    except ValueError as e:
        problems.append(Problem(rel, f"not valid JSON ({e})", fix))
        return None


def _sha256(
    run: RunFolder, rel: str, sha: Any, against: str, fix: str, problems: list[Problem]
) -> None:
    """A problem for `rel` when it is missing or its sha256 is not `sha`, as `against` records."""
    try:
        ok = sha256_hex(run.read_bytes(rel)) == sha
    except FileNotFoundError:
        problems.append(Problem(rel, "missing", fix))
        return
    if not ok:
        problems.append(Problem(rel, f"sha256 does not match {against}", fix))


def _records(run: RunFolder, problems: list[Problem]) -> None:
    for rel in RECORDS:
        _json(run, rel, "restore it, or delete it and run the stage that writes it again", problems)
    for stage in SHARD_STAGES:
        _json(run, f"{stage}/_COMPLETE", f"delete it and resume: the {stage} stage writes it again", problems)
    for name in run.listdir(STAGE_CLOCKS):
        if not name.startswith(TMP_PREFIX):
            _json(run, f"{STAGE_CLOCKS}/{name}", "delete it: the stage writes its clock again when it runs", problems)


def _shards(run: RunFolder, stage: str, problems: list[Problem]) -> int:
    store = ShardStore(run, stage)
    markers: dict[str, dict[str, Any]] = {}
    for name in run.listdir(f"{stage}/_SUCCESS"):
        if name.startswith(TMP_PREFIX) or not name.endswith(".json"):
            continue
        rel = f"{stage}/_SUCCESS/{name}"
        marker = _json(run, rel, redo_hint(rel), problems)
        if marker is not None:
            markers[name.removesuffix(".json")] = marker
    for shard_id, what in sorted(store.damaged(markers, hash_data=True).items()):
        key = store.marker_key(shard_id)
        fix = redo_hint(key)
        if stage in ("generate", SYNTHESIS_STAGE):
            fix += " (generation also rebuilds it from its journal on its own at the next resume)"
        problems.append(Problem(key, what.removeprefix(f"{run.url}/"), fix))
    return len(markers)


def _prompts(run: RunFolder, problems: list[Problem]) -> None:
    fix = (f"delete {DISCOVERY_MARKER} and resume: discovery writes the tables again (the same "
           "prompts from the same sources, so the run's fingerprint still matches)")  # fmt: skip
    marker = _json(run, DISCOVERY_MARKER, fix, problems)
    for name, entry in ((marker or {}).get("files") or {}).items():
        rel = entry.get("path") or f"prompts/{name}.parquet"
        _sha256(run, rel, entry.get("sha256"), DISCOVERY_MARKER, fix, problems)


def _checkpoints(run: RunFolder, problems: list[Problem]) -> int:
    checked = 0
    for name in run.listdir(TRAIN_CHECKPOINTS):
        folder = f"{TRAIN_CHECKPOINTS}/{name}"
        fix = f"delete {folder}: training resumes from the checkpoint before it"
        meta = _json(run, f"{folder}/meta.json", fix, problems)
        if meta is None:  # no meta.json: not a checkpoint yet; removed when training starts
            continue
        checked += 1
        for file, sha in (meta.get("sha256") or {}).items():
            _sha256(run, f"{folder}/{file}", sha, "its meta.json", fix, problems)
    return checked


def safetensors_problem(data: bytes) -> str | None:
    """Why `data` is not a whole safetensors file (its header names more bytes than there
    are, or cannot be read), or None."""
    if len(data) < 8:
        return f"{len(data)} bytes: too short for a safetensors header"
    (size,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError:
        return "its safetensors header is not readable"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + size + end != len(data):
        return f"{len(data):,} bytes, its safetensors header describes {8 + size + end:,}"
    return None


def _exports(run: RunFolder, problems: list[Problem]) -> int:
    fix = "resume with the train stage: it exports the best checkpoint again"
    checked = 0
    for folder in (TRAIN_FINAL, TRAIN_FINAL_SPECULATORS):
        names = run.listdir(folder)
        if not names:
            continue
        checked += 1
        if "config.json" not in names:
            problems.append(Problem(f"{folder}/config.json", "missing (the export did not finish)", fix))
        else:
            _json(run, f"{folder}/config.json", fix, problems)
        for name in names:
            if name.endswith(".safetensors"):
                what = safetensors_problem(run.read_bytes(f"{folder}/{name}"))
                if what:
                    problems.append(Problem(f"{folder}/{name}", what, fix))
    return checked


def verify_run(run: RunFolder) -> tuple[list[Problem], dict[str, int]]:
    """Every problem found, and how much was checked."""
    problems: list[Problem] = []
    _records(run, problems)
    _prompts(run, problems)
    counts = {f"{stage} shards": _shards(run, stage, problems) for stage in SHARD_STAGES}
    counts["checkpoints"] = _checkpoints(run, problems)
    counts["exported drafts"] = _exports(run, problems)
    return problems, counts


def verify_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="eaglescale verify", description="Check every file a run folder vouches for."
    )
    parser.add_argument("run_root", metavar="RUN_ROOT", help="run folder: local path or fsspec URL")
    args = parser.parse_args(argv)
    fs, root = fsspec.core.url_to_fs(args.run_root)
    if not fs.exists(f"{root.rstrip('/')}/run.json"):
        print(f"eaglescale verify: {args.run_root} holds no run (no run.json)", file=sys.stderr)
        return EXIT_MISSING
    run = RunFolder(args.run_root)
    problems, counts = verify_run(run)
    checked = ", ".join(f"{n} {what}" for what, n in counts.items())
    for p in problems:
        print(f"{run.url}/{p.path}: {p.what}\n  fix: {p.fix}")
    if problems:
        print(f"eaglescale verify: {len(problems)} problem(s) ({checked} checked)", file=sys.stderr)
        return EXIT_PROBLEMS
    print(f"eaglescale verify: {run.url} is whole ({checked}, prompt tables and records checked)")
    return EXIT_OK
