"""What `node wait` leaves in $OUT, whatever stage the pipeline is in: status.json, the
measurements, pipeline.log's tail and results.tar.gz (the run folders' reports, the helper
records, the ends of the logs, a server log's start and end), and the generation once it is
complete (travel.collect_generation). At most a few MB a call.

Standard library only: `node wait` runs on the node's own Python."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

from gpunode import node_env
from gpunode.import_profile import IMPORT_PROFILE
from gpunode.plans import RECIPE_ROOT
from gpunode.travel import collect_generation

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
