"""The node's side of a session, call by call: `node receive N` (a payload part, checked),
`node start` (the pipeline as a daemon that outlives the call, with the plan's options and the
device time it has), `node wait` (follows it, and leaves the results so far in $OUT every minute:
collect_node_results)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from benchmarks.h200 import node_env
from benchmarks.h200.import_profile import IMPORT_PROFILE
from benchmarks.h200.node_env import read_json, sha256
from benchmarks.h200.plans import NEEDS_DRAFT, RECIPE_ROOT, parse_settings, plan_options
from benchmarks.h200.travel import PACKED, calls_for, carried, collect_generation


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
    subprocess.Popen([sys.executable, str(node_env.RUNNER), "node", "pipeline"], cwd=node_env.REPO,
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


# What `node wait` brings back of the run folder. gate/scaling/replay.json and gate/progress.json
# are written as the gate goes: a gate cut short (the sixth run's, by the session's end) still
# shows the scaling drafts replayed and every launch measured, per domain.
RESULT_FILES = (
    "run.json", "prompts/discovery_report.json", "prompts/_SUCCESS.json", "generate/progress.json",
    "train/result.json", "train/best.json", "train/data.json", "train/scaling/index.json", "train/plots/accuracy.png",
    "gate/report.json", "gate/report.md", "gate/progress.json", "gate/replay.json", "gate/costs.json",
    "gate/prediction.json", "gate/scaling/replay.json", "gate/scaling/report.json", "gate/scaling/curve.png",
    "gate/plots/tok_s.png", "gate/plots/acceptance.png", "gate/plots/predicted_vs_measured.png", "promoted.json",
    "gate/plots/breakeven.png", "gate/load.json", "gate/serving-policy.json", "gate/sglang-adaptive.json",
    "gate/plots/load.png",
)  # fmt: skip


# What comes back of the run roots beside the run (the "online-incumbent", "lossless" and "recipe"
# plans'), besides each root's stage clocks.
SIBLING_RESULT_FILES = ("run.json", "train/result.json", "train/best.json", "train/data.json", "promoted.json",
                        "gate/report.json", "gate/report.md", "gate/progress.json", "gate/replay.json")  # fmt: skip


def _add_root(tar: tarfile.TarFile, root: Path, rels: tuple[str, ...]) -> None:
    """`rels` of a run root that exist, and its stage clocks, under the root's name."""
    for rel in rels:
        if (root / rel).is_file():
            tar.add(root / rel, f"{root.name}/{rel}")
    for path in sorted(root.glob("stages/*.json")):  # each stage's clock
        tar.add(path, f"{root.name}/{path.relative_to(root)}")


HEAD_LINE_BYTES = 1_000  # a server log's head line is kept up to this: its server_args line is ~9.4 KB


def _head_lines(data: bytes, head: int) -> tuple[bytes, int]:
    """The first lines of `data` in about `head` bytes, each line longer than HEAD_LINE_BYTES cut
    to that with the count of what was cut, and how many bytes of `data` they stand for. Run 18's
    10 KB heads held the warnings and SGLang's one 9.4 KB server_args line, and none of the
    start-up after it."""
    kept, size, consumed = [], 0, 0
    for line in data.splitlines(keepends=True):
        short = line
        if len(line) > HEAD_LINE_BYTES:
            short = line[:HEAD_LINE_BYTES] + f" [... {len(line) - HEAD_LINE_BYTES} bytes of this line left out]\n".encode()
        if size + len(short) > head:
            break
        kept.append(short)
        size, consumed = size + len(short), consumed + len(line)
    return b"".join(kept), consumed


def _add_ends(tar: tarfile.TarFile, path: Path, name: str, limit: int, head: int = 0) -> None:
    """The last `limit` bytes of `path` in `tar` as `name`, after its first lines in `head` bytes
    (_head_lines). (The gate's own cut, tasks.gate.progress.log_head_and_tail, is not importable
    here: `node wait` runs without the packages tasks/ needs.)"""
    data = path.read_bytes()
    if len(data) > head + limit:
        first, consumed = _head_lines(data[:-limit], head) if head else (b"", 0)
        cut = f"[... {len(data) - limit - consumed} bytes left out ...]\n".encode() if head else b""
        data = first + cut + data[-limit:]
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def collect_node_results(out: Path) -> None:
    """status.json, pipeline.log's tail and results.tar.gz (the run folder's reports, the
    measurements' JSON, the ends of the logs) in `out`: at most a few MB, whatever stage it is in."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("status.json", "measurements.json"):
        if (node_env.NODE / name).is_file():
            shutil.copyfile(node_env.NODE / name, out / name)
    log = node_env.NODE / "pipeline.log"
    if log.is_file():
        (out / "pipeline-tail.log").write_bytes(log.read_bytes()[-400_000:])
    run = node_env.NODE / "run"
    partial = out / "results.tar.gz.partial"  # renamed when whole: a kill never leaves half an archive
    with tarfile.open(partial, "w:gz") as tar:
        _add_root(tar, run, RESULT_FILES)
        for path in sorted(run.glob("train/scaling/frac-*/result.json")) + sorted(run.glob("generate/_SUCCESS/*.json")) + sorted(run.glob("extract/_SUCCESS/*.json")):
            tar.add(path, f"run/{path.relative_to(run)}")
        # The "online-incumbent", "lossless" and "recipe" plans' run roots beside the run; then the
        # replay, the registry and the probe's recorded answers.
        recipe = sorted(p.name for p in node_env.NODE.glob(f"{RECIPE_ROOT}*"))  # the recipe plan's variants
        for name in ("run-online", "run-1k", "run-penalty", *recipe):
            _add_root(tar, node_env.NODE / name, SIBLING_RESULT_FILES)
        for path in [node_env.NODE / "replay-compare.json", node_env.NODE / "recipe-replay.json", node_env.NODE / "drafts/index.json",
                     node_env.NODE / "checkpoint/index.json", node_env.NODE / "generation/index.json", node_env.NODE / "train-fit.json", node_env.NODE / "carried.json", node_env.NODE / "options.json",
                     node_env.NODE / IMPORT_PROFILE,
                     *sorted(node_env.NODE.glob("recorded/*.json")), *sorted(node_env.NODE.glob("registry/*.json")),
                     *sorted(node_env.NODE.glob("registry/history/*.json"))]:  # fmt: skip
            if path.is_file():
                tar.add(path, str(path.relative_to(node_env.NODE)))
        for path in sorted((node_env.NODE / "logs").glob("*.log")):
            _add_ends(tar, path, f"logs/{path.name}", 200_000)  # the tail: what says why
        for path in sorted(run.glob("gate/server-logs/*.log")):  # the gate keeps their start and end
            _add_ends(tar, path, f"server-logs/{path.name}", 16_000, head=10_000)
        for path in (node_env.NODE / "specforge/specforge_train.json", node_env.NODE / "specforge/draft/config.json"):
            if path.is_file():
                tar.add(path, f"specforge/{path.name}")
    partial.replace(out / "results.tar.gz")
    collect_generation(out)
