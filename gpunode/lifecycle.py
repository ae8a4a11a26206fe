"""The node's side of a session, call by call: `node receive N` (a payload part, checked),
`node start` (the pipeline as a daemon that outlives the call, with the plan's options and the
device time it has), `node wait` (follows it, and leaves the results so far in $OUT every minute:
collection.collect_node_results)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from typing import Any

from gpunode import node_env
from gpunode.collection import collect_node_results
from gpunode.node_env import read_json, sha256
from gpunode.plans import NEEDS_DRAFT, parse_settings, plan_options
from gpunode.travel import PACKED, calls_for, carried


def node_receive(k: int) -> int:
    carried = node_env.REPO / ".eaglescale/h200/payload" / f"part-{k}"
    manifest = json.loads((carried / "manifest.json").read_text())
    parts = node_env.NODE / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    entry = manifest["parts"][k - 1]
    shutil.copyfile(carried / "data", parts / entry["name"])
    if sha256(parts / entry["name"]) != entry["sha256"]:
        (parts / entry["name"]).unlink()
        print(f"node receive {k}: sha256 mismatch", file=sys.stderr)
        return 4
    (node_env.NODE / "manifest.json").write_text(json.dumps(manifest))
    have = sum(1 for p in manifest["parts"] if (parts / p["name"]).is_file())
    # Kept whatever came before it: a machine replaced mid-payload (run 15: a gap of over 30 s
    # between two calls) needs only the earlier parts again, not this one and those after it.
    missing = [p["name"] for p in manifest["parts"][: k - 1] if not (parts / p["name"]).is_file()]
    if missing:
        print(f"node receive {k}: kept; {missing} are not on this machine (it started bare): send them again",
              file=sys.stderr)  # fmt: skip
        return 3
    print(f"node receive {k}: ok ({have}/{len(manifest['parts'])} parts here)")
    return 0


def node_start(budget_s: float | None, skip: list[str], plan: str = "full", variants: list[str] | None = None,
               overrides: list[str] | None = None) -> int:  # fmt: skip
    try:
        settings = parse_settings(overrides or [])
    except ValueError as e:
        print(f"node start: {e}", file=sys.stderr)
        return 2
    manifest = json.loads((node_env.NODE / "manifest.json").read_text())
    missing = [p["name"] for p in manifest["parts"] if not (node_env.NODE / "parts" / p["name"]).is_file()]
    if missing:
        print(f"node start: parts {missing} missing", file=sys.stderr)
        return 3
    if manifest.get("carried", {}).get("anchor") and (plan != "recipe" or "anchor" in skip):
        print(f"node start --plan {plan}{' --skip anchor' if 'anchor' in skip else ''}: this payload carries SpecForge's "
              "draft (prepare --anchor-from), which only the recipe plan gates, and only without --skip anchor",
              file=sys.stderr)  # fmt: skip
        return 2
    if plan in NEEDS_DRAFT and not manifest.get("carried", {}).get("draft"):
        print(f"node start --plan {plan}: it gates a draft an earlier session trained, and this payload carries none "
              "(prepare --draft-from DRAFTS_TAR)", file=sys.stderr)  # fmt: skip
        return 2
    if budget_s is not None:  # read by the pipeline: when SpecForge must stop at the latest
        (node_env.NODE / "deadline.json").write_text(json.dumps({"ends_at": time.time() + budget_s, "budget_s": budget_s}))
    (node_env.NODE / "options.json").write_text(json.dumps(plan_options(skip, plan, variants, settings)))  # read by the pipeline
    log = (node_env.NODE / "pipeline.log").open("ab")
    subprocess.Popen([sys.executable, *node_env.node_step("pipeline")], cwd=node_env.REPO,
                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    print(f"node start: pipeline running (setsid), log {node_env.NODE / 'pipeline.log'}")
    return 0


def node_wait(timeout: float) -> int:
    """Follow the pipeline until it ends or `timeout` passes; leave the results so far in $OUT.
    It also ends as soon as a draft is packed during the call, so that the draft travels at once
    (`node drafts K`) while the pipeline goes on: run 17's came back 8 parts of 15 when the
    session's device time ran out in the gate after it. So it does when the generation completes
    (a run's own, not one the payload carried): it comes back at once. On a machine where no pipeline was
    started (a fresh one: the machine that ran it was given back between calls) it says so at
    once, rather than spend the call's device time waiting."""
    if not (node_env.NODE / "options.json").is_file():  # node start writes it before the pipeline starts
        print("node wait: no pipeline was started on this machine (it started bare: the one that ran it was "
              "given back); what earlier `node wait` calls brought back is all there is", file=sys.stderr)  # fmt: skip
        return 3
    out = node_env.out_dir()
    began, last, collected = time.time(), None, time.time()
    status: dict[str, Any] = {}
    while True:
        status = read_json(node_env.NODE / "status.json") or {}
        step = (status.get("step"), status.get("state"))
        if step != last:
            print(f"[{time.time() - began:6.0f}s] {status.get('step')}: {status.get('state')} "
                  f"{status.get('detail', '')}", flush=True)  # fmt: skip
            last = step
        if status.get("state") in ("done", "failed") or time.time() - began > timeout:
            break
        just = [name for name in PACKED if _ended_since(status, PACKED[name], began)]
        if just:
            print(f"node wait: just packed: {', '.join(just)}; fetch it now ({', '.join(f'`node {n} K`' for n in just)}, "
                  "below), then `node wait` again; the pipeline goes on", flush=True)  # fmt: skip
            break
        if _ended_since(status, "generate", began) and not carried()["generation"]:
            # Run 21's came back only when its draft, which could not finish, had used the session.
            print("node wait: the generation just completed; it comes back now (generation.tar.part-NN here, or "
                  "`node generation K` as below), then `node wait` again; the pipeline goes on", flush=True)  # fmt: skip
            break
        if time.time() - collected > 60:  # a call cut short by the session's device time still returns these
            collect_node_results(out)
            collected = time.time()
        time.sleep(5)
    collect_node_results(out)
    print(json.dumps({k: status.get(k) for k in ("step", "state", "detail", "steps")}, indent=1)[-3000:])
    for name in (*PACKED, "generation"):  # drafts, a checkpoint, a large generation: too big for this call's files
        index = read_json(node_env.NODE / name / "index.json")
        if index:
            calls = calls_for(index["bytes"])
            what = list(index["drafts"]) if name == "drafts" else index[name]
            print(f"{name} {what} packed in {len(index['parts'])} parts ({index['bytes'] / 1e6:.0f} MB): "
                  f"`node {name} K` for K in 0..{calls - 1}")  # fmt: skip
    return 0 if status.get("state") != "failed" else 1


def _ended_since(status: dict[str, Any], name: str, since: float) -> bool:
    """Whether the pipeline's step `name` (a PACKED one, or the generation) ended, done, since."""
    step = (status.get("steps") or {}).get(name) or {}
    return step.get("state") == "done" and (step.get("began_at") or 0) + (step.get("seconds") or 0) >= since
