"""`eaglescale export-data RUN_ROOT OUT.jsonl`: the regenerated dataset for other trainers.

One conversation per line, in the format SpecForge's training scripts read and speculators'
data generation reads (both take `conversations`, a list of `{"role", "content"}` turns):

    {"id": <request_id>, "conversations": [<the prompt's messages>...,
     {"role": "assistant", "content": <the regenerated response>}],
     "prompt_id": ..., "sample_index": ..., "domain": ..., "source": ..., "finish_reason": ...}

Only committed rows are written (dead letters are not), shard by shard in shard order, each
shard's bytes verified against its marker; the manifest's messages are the prompt, as rendered
for generation. The extra keys are ignored by both readers; `finish_reason` "length" marks a
response cut at sampling.max_new_tokens, for those who want to filter them out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import fsspec

from tasks.discover.commit import discovery_marker, read_prompts_table
from tasks.generate.shard import STAGE
from tasks.runfolder import CorruptShard, RunFolder, ShardStore
from tasks.runfolder.layout import SHARD_PLAN

EXIT_OK, EXIT_FAILED, EXIT_MISSING = 0, 1, 2


def export_conversations(run: RunFolder, out: str) -> dict[str, Any]:
    """Write the JSONL to `out` (a local path or fsspec URL; a local file appears whole, via
    a temp file and a rename). Returns the counts."""
    manifest = read_prompts_table(run, "manifest")
    prompts = {
        row["prompt_id"]: row
        for row in manifest.select(["prompt_id", "messages", "domain", "source"]).to_pylist()
    }
    store = ShardStore(run, STAGE)
    markers = store.committed()
    plan = run.read_json(SHARD_PLAN) or {}
    counts = {"conversations": 0, "shards": len(markers), "shards_planned": len(plan.get("shards", [])),
              "finish_length": 0, "complete": store.is_complete()}  # fmt: skip
    fs, path = fsspec.core.url_to_fs(out)
    if fs.isdir(path):  # before every shard is read and written
        raise IsADirectoryError(f"{out} is a folder; give a file name")
    tmp = f"{path}.partial"
    with fs.open(tmp, "w", encoding="utf-8") as f:
        for _, marker in sorted(markers.items()):
            for row in store.read_rows(marker).to_pylist():
                prompt = prompts[row["prompt_id"]]
                turns = [*json.loads(prompt["messages"]), {"role": "assistant", "content": row["text"]}]
                line = {"id": row["request_id"], "conversations": turns, "prompt_id": row["prompt_id"],
                        "sample_index": row["sample_index"], "domain": prompt["domain"],
                        "source": prompt["source"], "finish_reason": row["finish_reason"]}  # fmt: skip
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
                counts["conversations"] += 1
                counts["finish_length"] += row["finish_reason"] == "length"
    fs.mv(tmp, path)
    return counts


def export_data_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="eaglescale export-data",
        description="Write a run's regenerated dataset as JSONL conversations (SpecForge, speculators).",
    )
    parser.add_argument("run_root", metavar="RUN_ROOT", help="run folder: local path or fsspec URL")
    parser.add_argument("out", metavar="OUT.jsonl", help="file to write (local path or fsspec URL)")
    args = parser.parse_args(argv)
    run_fs, root = fsspec.core.url_to_fs(args.run_root)
    run = RunFolder(args.run_root) if run_fs.exists(root) else None  # a local RunFolder mkdirs
    if run is None or discovery_marker(run) is None:
        print(f"eaglescale export-data: {args.run_root} holds no committed prompts (no run, or "
              "discovery has not finished)", file=sys.stderr)  # fmt: skip
        return EXIT_MISSING
    try:
        counts = export_conversations(run, args.out)
    except (CorruptShard, IsADirectoryError) as e:
        print(f"eaglescale export-data: {e}", file=sys.stderr)
        return EXIT_FAILED
    where = os.path.abspath(args.out) if "://" not in args.out else args.out
    note = "" if counts["complete"] else " (generation is not complete: committed shards only)"
    print(f"eaglescale export-data: {counts['conversations']:,} conversations from {counts['shards']} of "
          f"{counts['shards_planned']} shards to {where}{note}; {counts['finish_length']:,} cut at "
          "max_new_tokens (finish_reason length)")  # fmt: skip
    return EXIT_OK
