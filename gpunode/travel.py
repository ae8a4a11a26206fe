"""What travels from one session to the next (issue 28's run spans sessions, each on a fresh node):
the regenerated shards, a trained draft, a training checkpoint and the data-scaling drafts, packed
on the node in parts small enough for what one call brings back through $OUT, and unpacked here
into the next payload's run folder (`prepare --run-from` / `--draft-from` / `--checkpoint-from` /
`--scaling-from`, SpecForge's draft of a recipe session: `--anchor-from`, and a draft to continue:
`--start-from`); what a node's run folder came with (carried.json).

Standard library only: the pipeline process packs them on the node's own Python."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpunode import node_env
from gpunode.node_env import read_json, sha256


def run_holds(run: Path) -> dict[str, bool]:
    """What a run folder holds of what travels: its generation complete, an exported draft, a
    complete training checkpoint of its draft (one to resume from), the index of its finished
    data-scaling drafts."""
    return {"generation": (run / "generate/_COMPLETE").is_file(), "draft": (run / "train/final/config.json").is_file(),
            "checkpoint": newest_checkpoint(run) is not None,
            "scaling": (run / SCALING_INDEX).is_file()}  # fmt: skip


# A training checkpoint counts once its meta.json exists (tasks/draft/checkpoint.py, which this
# module cannot import: the pipeline process has no torch).
_CHECKPOINT = re.compile(r"^step-(\d+)$")
# Where the train stage keeps the data-scaling drafts and lists the finished ones
# (tasks/draft/scaling_drafts.py's SCALING_TRAIN_ROOT and SCALING_INDEX).
SCALING_ROOT = "train/scaling"
SCALING_INDEX = f"{SCALING_ROOT}/index.json"


def stopped_draft(run: Path) -> Path:
    """The train folder of the draft that training resumes: a data-scaling draft that a time
    budget stopped (the scaling index names it; with train.forecast_full_draft they train before
    the run's draft), unless the run's own draft is the one stopped; else the run's train/."""
    scaling = (read_json(run / SCALING_INDEX) or {}).get("stopped_for_budget")
    if scaling and not (read_json(run / "train/result.json") or {}).get("stopped_for_budget"):
        return run / scaling
    return run / "train"


def newest_checkpoint(run: Path) -> Path | None:
    """The newest complete checkpoint (checkpoints/step-N with its meta.json) of the draft that
    training resumes (stopped_draft), or None."""
    return _newest_step(stopped_draft(run) / "checkpoints")


def _newest_step(checkpoints: Path) -> Path | None:
    """The newest step-N folder in `checkpoints` with its meta.json, or None."""
    steps = [(int(m.group(1)), p) for p in checkpoints.glob("step-*")
             if (m := _CHECKPOINT.match(p.name)) and (p / "meta.json").is_file()]  # fmt: skip
    return max(steps)[1] if steps else None


def carried() -> dict[str, bool]:
    """What this node's run folder came with from an earlier session (`prepare --run-from`,
    `--draft-from`, `--checkpoint-from` and `--scaling-from`), as setup recorded it before any
    stage ran."""
    return {"checkpoint": False, "scaling": False,
            **(read_json(node_env.NODE / "carried.json") or run_holds(node_env.NODE / "src/run"))}  # fmt: skip


# The run's prompts and regenerated shards, brought back whole once generation is complete, so a
# later session's run on a fresh node starts from them instead of regenerating (`node receive`
# carries them in as part of the payload's run folder): in `node wait`'s own files, in parts of
# PART_BYTES, when they fit beside its results in what one call brings back (64 MiB); else packed
# in parts like a draft (NODE/generation, `node generation K`). A generation the pipeline stopped
# because its session was ending (Pipeline.watch_generation: GENERATION_STOPPED says so) travels
# the same way, with the journals of its uncommitted shards: the next session's node resumes it
# and sends only the requests no journal holds.
GENERATION_MAX_BYTES = 45_000_000
GENERATION_STOPPED = "generation-stopped.json"
# Device seconds that `node wait`'s own call costs beside what it brings back (run 19's: ~5-10 s).
NODE_WAIT_CALL_S = 15.0


def generation_travel_s(nbytes: int) -> float:
    """Device seconds that bringing back a generation.tar of `nbytes` costs after the pipeline
    packed it: `node wait`'s call, and the `node generation K` calls when it does not fit there."""
    parts_calls = 0 if nbytes <= GENERATION_MAX_BYTES else calls_for(nbytes)
    return NODE_WAIT_CALL_S + parts_calls * SECONDS_PER_CALL


def generation_bytes(run: Path) -> int:
    """What pack_generation would pack of `run` now (prompts/ and generate/, leases and committed
    shards' journals aside, which it leaves out): the measure of its way back."""
    total = 0
    for f in _generation_files(run):
        try:  # the stage writes run.json after its start, and a journal may be replaced meanwhile
            total += f.stat().st_size
        except FileNotFoundError:
            continue
    return total


# The run folder's shard stages that travel with its prompts: a synthesized source's prompts
# (synthesize/, written on the node before discovery reads them) and the regenerated replies.
SHARD_STAGES = ("synthesize", "generate")


def _generation_files(run: Path) -> list[Path]:
    files = [f for f in (run / "run.json",) if f.is_file()]
    files += [f for f in (run / "prompts").rglob("*") if f.is_file()]
    for stage in SHARD_STAGES:
        committed = {m.stem for m in (run / stage / "_SUCCESS").glob("*.json")}
        for f in (run / stage).rglob("*") if (run / stage).is_dir() else []:
            rel = f.relative_to(run / stage).parts
            if not f.is_file() or rel[0] == "leases" or (rel[0] == "journal" and rel[1] in committed):
                continue  # a lease is this machine's; a committed shard's journal is in its data
            files.append(f)
    return files


def pack_generation(run: Path, packed: Path) -> None:
    """generation.tar of `run`: run.json, prompts/, synthesize/ and generate/, without leases,
    and without the journals of committed shards (a complete generation has none left to need)."""
    partial = packed.with_suffix(".partial")
    with tarfile.open(partial, "w") as tar:
        for f in sorted(_generation_files(run)):
            tar.add(f, f"run/{f.relative_to(run)}")
    partial.replace(packed)


def collect_generation(out: Path) -> None:
    """generation.tar, once generate/_COMPLETE exists or the pipeline stopped the generation for
    the session's end (GENERATION_STOPPED, packed then): as generation.tar.part-NN in `out` when
    it fits (GENERATION_MAX_BYTES), else as parts under NODE/generation that `node generation K`
    brings back, which generation.txt in `out` names. A prompt per user turn (`prompt_turns:
    every_user`) makes it larger than one call: ~4x the replies and ~9x the prompts' text."""
    run, packed = node_env.NODE / "run", node_env.NODE / "generation.tar"
    stopped = read_json(node_env.NODE / GENERATION_STOPPED)
    if stopped is None and (not (run / "generate/_COMPLETE").is_file() or carried()["generation"]):
        return  # not complete yet, or carried in by the payload (`prepare --run-from`): this session has it
    index = read_json(node_env.NODE / "generation/index.json")
    if index is None:
        if not packed.is_file():
            pack_generation(run, packed)
        size = packed.stat().st_size
        if size <= GENERATION_MAX_BYTES:
            with packed.open("rb") as f:
                for k in range(-(-size // PART_BYTES)):
                    (out / f"generation.tar.part-{k:02d}").write_bytes(f.read(PART_BYTES))
            return
        shards = len(list((run / "generate/_SUCCESS").glob("*.json")))
        index = split_parts(packed, "generation", {"generation": {"shards": shards, "complete": stopped is None}})
    calls = calls_for(index["bytes"])
    (out / "generation.txt").write_text(
        f"generation.tar is {index['bytes']} bytes, more than `node wait` brings back beside its results: "
        f"{len(index['parts'])} parts, `node generation K` for K in 0..{calls - 1}\n")  # fmt: skip


def unpack_generation(packed: Path, dest: Path) -> Path:
    """An earlier session's generation.tar (what `node wait` brought back, its parts joined:
    run.json, prompts/, synthesize/, generate/ without leases) unpacked as dest/run, which it
    returns; refused, naming the file, unless every member lies under run/ and it holds the run's
    committed prompts, or the synthesis a node was running before its discovery (a synthesized
    source's: the next node resumes it, then discovers). Its generation may be complete (a node
    that finds generate/_COMPLETE does not regenerate: Pipeline.generated) or stopped for its
    session's end (the node resumes it from the journals it holds): run_holds says which."""
    _unpack(packed, dest, "run/", "not a generation.tar of `node wait`",
            ("run/prompts/_SUCCESS.json", "run/synthesize/"), "not a run folder's generation or synthesis")  # fmt: skip
    return dest / "run"


# An earlier run's complete generation whose replies a grown run reuses (`prepare --reuse-from`,
# generate.reuse_from): in the payload beside the run folder, never sent back.
CARRIED_REUSE = "src/reuse-from/run"


def unpack_reuse_from(packed: Path, dest: Path) -> Path:
    """An earlier run's generation.tar (a complete one: run 15's is in the repository) unpacked
    as dest/reuse-from/run, which it returns; refused, naming the file, as unpack_generation
    refuses, or when its generation is not complete (a stopped one resumes with --run-from)."""
    run = unpack_generation(packed, dest / "reuse-from")
    if not run_holds(run)["generation"]:
        shutil.rmtree(dest / "reuse-from")
        raise ValueError(f"{packed}: its generation is not complete; what a grown run reuses is a finished run's "
                         "replies (a stopped generation resumes with --run-from)")  # fmt: skip
    return run


def carried_reuse() -> Path | None:
    """The earlier run whose replies this node's generation reuses (`prepare --reuse-from`), or None."""
    path = node_env.NODE / CARRIED_REUSE
    return path if (path / "run.json").is_file() else None


PART_BYTES = 15_000_000  # what comes back in parts (`node wait`'s generation, `node drafts|checkpoint|generation K`), in parts of this many bytes
PARTS_PER_CALL = 4  # 60 MB: what one call brings back (8 files, 64 MiB together)
# Device seconds a call that brings back PARTS_PER_CALL parts costs: run 18's four `node drafts`
# calls (213 MB) took 30 s of device time, ~8 s each; run 22's 22 `node checkpoint` calls (1.28 GB)
# took 236 s, ~11 s each, with its stop planned at 8 s a call and 4 s to spare: the slower figure.
SECONDS_PER_CALL = 11.0
# What travels in parts, each under NODE/<name>/ as <name>.tar.part-NN with index.json, and the
# pipeline's step that packs it: the drafts a plan trained, a draft's training checkpoint
# when it stopped mid-schedule, and the data-scaling drafts (qwen-scaling: trained in one session,
# gated in the next when the first has too little time left for their gate).
PACKED = {"drafts": "draft-pack", "checkpoint": "checkpoint-pack", "scaling-drafts": "scaling-pack"}


def calls_for(nbytes: int) -> int:
    """How many `node drafts K` / `node checkpoint K` calls bring back `nbytes` packed (an
    index's "bytes": its parts, PARTS_PER_CALL a call)."""
    return -(-nbytes // (PART_BYTES * PARTS_PER_CALL))


def pack_parts(members: dict[str, Path], index: dict[str, Any], name: str = "drafts") -> dict[str, Any]:
    """`members` (name in the tar -> file or folder) as NODE/<name>/<name>.tar.part-NN of
    PART_BYTES each and index.json (`index` with the parts, the whole's sha256 and bytes):
    what `node <name> K` returns. Returns the index."""
    packed = node_env.NODE / f"{name}.tar"
    with tarfile.open(packed, "w") as tar:
        for member, path in members.items():
            tar.add(path, member)
    return split_parts(packed, name, index)


def split_parts(packed: Path, name: str, index: dict[str, Any]) -> dict[str, Any]:
    """The tar `packed` as NODE/<name>/<name>.tar.part-NN of PART_BYTES each and index.json
    (`index` with the parts, the whole's sha256 and bytes), the tar removed. Returns the index."""
    folder = node_env.NODE / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    parts = []
    with packed.open("rb") as f:
        while data := f.read(PART_BYTES):
            parts.append(f"{name}.tar.part-{len(parts):02d}")
            (folder / parts[-1]).write_bytes(data)
    index = {**index, "parts": parts, "sha256": sha256(packed), "bytes": packed.stat().st_size}
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    packed.unlink()
    return index


def node_packed(name: str, k: int) -> int:
    """Parts PARTS_PER_CALL*k onwards of what the pipeline packed under NODE/<name> (PACKED),
    and their index.json, into $OUT. Here: `cat DIR*/<name>.tar.part-* > <name>.tar`, checked
    against index.json's sha256."""
    out = node_env.out_dir()
    index = read_json(node_env.NODE / name / "index.json")
    if index is None:
        print(f"node {name}: nothing packed (drafts: the recipe plan packs its drafts after its gate, the qwen plans "
              "theirs once trained; checkpoint: a draft's, when its time budget stopped it before the end of its schedule; "
              "scaling-drafts: qwen-scaling's, once trained; "
              "generation: `node wait`, once generation is complete, when it is too large for its own files)",
              file=sys.stderr)  # fmt: skip
        return 3
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(node_env.NODE / name / "index.json", out / "index.json")
    mine = index["parts"][PARTS_PER_CALL * k : PARTS_PER_CALL * (k + 1)]
    for part in mine:
        shutil.copyfile(node_env.NODE / name / part, out / part)
    calls = calls_for(index["bytes"])
    print(f"node {name} {k}: {mine} of {len(index['parts'])} parts ({calls} calls: node {name} 0..{calls - 1}); "
          f"{name} {index[name]}")  # fmt: skip
    return 0


def unpack_draft(packed: Path, dest: Path) -> Path:
    """An earlier session's draft (what `node drafts K` brought back, its parts joined: the run's
    train/ without checkpoints, its draft exported in bf16) unpacked into dest/run/train, which
    it returns; refused, naming the file, unless every member lies under run/train/ and it holds
    an exported draft. A node that finds it does not train that draft again."""
    _unpack(packed, dest, "run/train/", "not a draft of `node drafts`",
            "run/train/final/config.json", "no exported draft")  # fmt: skip
    return dest / "run/train"


def best_checkpoint(draft: Path) -> Path | None:
    """The checkpoint a draft's best.json names (run/train, or a scaling draft's folder: each
    writes it relative to its own train/), or None."""
    best = (read_json(draft / "best.json") or {}).get("checkpoint")
    return draft / best.removeprefix("train/") if best else None


def scaling_checkpoint(folder: Path) -> Path | None:
    """The checkpoint a finished scaling draft in `folder` (train/scaling/frac-N) was exported
    from: its best.json's (written relative to its own train/), else its newest; as the train
    stage chose it (tasks/draft/scaling_drafts.py). None where it has none: a draft carried from
    an earlier session, whose export and record came without its checkpoints."""
    chosen = best_checkpoint(folder) or _newest_step(folder / "checkpoints")
    return chosen if chosen is not None and (chosen / "meta.json").is_file() else None


def unpack_scaling_drafts(packed: Path, dest: Path) -> Path:
    """An earlier session's data-scaling drafts (what `node scaling-drafts K` brought back, its
    parts joined: train/scaling/index.json, each draft's record and the exports of those finished
    on that node) unpacked into dest/run/train/scaling, which it returns; refused, naming the file
    and what is wrong, with nothing extracted, unless every member lies under run/train/scaling/
    and the index lists a finished draft. The exports it lacks come from the sessions that trained
    them (unpack_oldest_first). A node that finds them does not train them again: the gate
    measures them."""

    def lists_drafts(tar: tarfile.TarFile, names: set[str]) -> None:
        if not json.load(tar.extractfile(f"run/{SCALING_INDEX}")).get("drafts"):  # type: ignore[arg-type]
            raise ValueError(f"{packed}: its scaling index lists no finished drafts")

    _unpack(packed, dest, f"run/{SCALING_ROOT}/", "not the scaling drafts of `node scaling-drafts`",
            f"run/{SCALING_INDEX}", "no finished scaling drafts", lists_drafts)  # fmt: skip
    return dest / "run" / SCALING_ROOT


# What a data-scaling draft's export (its final/, in SGLang's format) holds: the gate serves it, and
# the train stage skips a finished draft that has it.
SCALING_EXPORT_FILES = ("config.json", "model.safetensors")


def exported_samples(members: dict[str, Path]) -> list[int]:
    """The data-scaling drafts (by their training sequences) whose export is among a tar's
    `members` (Packing.scaling_members' names): what its index.json says it holds."""
    found = (re.fullmatch(rf"run/{SCALING_ROOT}/frac-(\d+)/final", name) for name in members)
    return sorted(int(m.group(1)) for m in found if m)


def unpack_oldest_first(tars: list[Path], unpack: Callable[[Path, Path], Path], dest: Path) -> None:
    """`prepare --checkpoint-from` or `--scaling-from` given once or again, oldest first: the
    newest unpacked into dest by `unpack`, and the exports of the finished data-scaling drafts its
    index lists and it lacks taken from the earlier ones (a node packs only the exports of the
    drafts it trained, Packing.scaling_members): each from the newest earlier tar that holds it.
    Refused, naming the drafts no tar holds, before anything is extracted; and when earlier tars
    are given where the newest lists no finished drafts for them to add."""
    *earlier, newest = tars
    taken = _exports_elsewhere(newest, earlier)
    unpack(newest, dest)
    for packed, finals in taken.items():
        with tarfile.open(packed) as tar:
            members = [m for m in tar.getmembers() if any((m.name + "/").startswith(f"run/{f}/") for f in finals)]
            tar.extractall(dest, members=members, filter="data")


def _exports_elsewhere(newest: Path, earlier: list[Path]) -> dict[Path, list[str]]:
    """Which of `earlier` gives each finished scaling draft's export (its final/, by name) that
    `newest`'s scaling index lists and `newest` lacks; ValueError as unpack_oldest_first says."""
    with tarfile.open(newest) as tar:
        names = set(tar.getnames())
        listed = f"run/{SCALING_INDEX}"
        drafts = json.load(tar.extractfile(listed)).get("drafts", []) if listed in names else []  # type: ignore[arg-type]
    if earlier and not drafts:
        raise ValueError(f"{earlier[0]}: given before {newest}, which lists no finished scaling drafts: only the "
                         "newest tar is carried, the earlier ones add the exports of the scaling drafts it lists")  # fmt: skip
    missing = {d["final"] for d in drafts if not _holds(names, d["final"])}
    taken: dict[Path, list[str]] = {}
    for packed in reversed(earlier):
        with tarfile.open(packed) as tar:
            held = sorted(f for f in missing if _holds(set(tar.getnames()), f))
        if held:
            taken[packed] = held
            missing -= set(held)
    if missing:
        raise ValueError(f"{newest}: its scaling index lists {', '.join(sorted(missing))} as finished, and neither "
                         "it nor a tar given before it holds the export: give the checkpoint.tar or "
                         "scaling-drafts.tar of the session that trained it too, before it (oldest first)")  # fmt: skip
    return taken


def _holds(names: set[str], final: str) -> bool:
    return all(f"run/{final}/{name}" in names for name in SCALING_EXPORT_FILES)


def checkpoint_members(run: Path) -> dict[str, Path]:
    """What a draft stopped mid-schedule leaves for the next session's node to resume
    from, by name in the tar: its newest checkpoint whole (weights, optimizer, RNG, trainer
    state, meta.json), its best one too where that is another (the export reads it) and its
    best.json; what the run's drafts share: the vocabulary map and, where the full draft's
    forecast is written, that forecast (it stands once written). Empty when it has no complete
    checkpoint. A stopped scaling draft's finished siblings travel beside it, exported
    (Packing.scaling_members)."""
    newest = newest_checkpoint(run)
    if newest is None:
        return {}
    draft = newest.parent.parent  # run/train, or run/train/scaling/frac-N
    members = {f"run/{newest.relative_to(run)}": newest}
    chosen = best_checkpoint(draft)
    if chosen is not None and (chosen / "meta.json").is_file() and chosen != newest:
        members[f"run/{chosen.relative_to(run)}"] = chosen
    if (draft / "best.json").is_file():
        members[f"run/{(draft / 'best.json').relative_to(run)}"] = draft / "best.json"
    for rel in ("vocab_map.safetensors", "forecast.json"):
        if (run / "train" / rel).is_file():
            members[f"run/train/{rel}"] = run / "train" / rel
    return members


def unpack_checkpoint(packed: Path, dest: Path) -> Path:
    """An earlier session's training checkpoint (what `node checkpoint K` brought back, its parts
    joined) unpacked into dest/run/train, which it returns; refused, naming the file and what is
    wrong, with nothing extracted, unless every member lies under run/train/, it holds a complete
    checkpoint (train/checkpoints/step-N/meta.json, or a data-scaling draft's under
    train/scaling/frac-N/) and every file each meta.json names is in it with that sha256. A node
    that finds it resumes that draft at that step."""
    with tarfile.open(packed) as tar:
        members = {m.name: m for m in tar.getmembers()}
        outside = [n for n in members if not (n + "/").startswith("run/train/")]
        if outside:
            raise ValueError(f"{packed}: members outside run/train/ ({outside[:3]}): not a checkpoint of `node checkpoint`")
        metas = sorted(n for n in members if re.fullmatch(r"run/train/(scaling/frac-\d+/)?checkpoints/step-\d+/meta.json", n))
        if not metas:
            raise ValueError(f"{packed}: no run/train/[scaling/frac-N/]checkpoints/step-N/meta.json in it: "
                             "no complete checkpoint")  # fmt: skip
        for meta_name in metas:
            folder = meta_name.rsplit("/", 1)[0]
            meta = json.load(tar.extractfile(members[meta_name]))  # type: ignore[arg-type]
            for name, want in meta["sha256"].items():
                member = members.get(f"{folder}/{name}")
                if member is None or not member.isfile():
                    raise ValueError(f"{packed}: {folder}/{name} is missing: the checkpoint is incomplete")
                if hashlib.file_digest(tar.extractfile(member), "sha256").hexdigest() != want:  # type: ignore[arg-type]
                    raise ValueError(f"{packed}: {folder}/{name} does not match the sha256 its meta.json records")
        tar.extractall(dest, filter="data")
    return dest / "run/train"


# Where a recipe plan's drafts.tar holds SpecForge's draft (pack_parts' member name), and where an
# earlier session's, carried in (`prepare --anchor-from`), lies in the payload's src folder.
ANCHOR_MEMBER = "specforge"
CARRIED_ANCHOR = "src/specforge/draft"


def unpack_anchor(packed: Path, dest: Path) -> Path:
    """SpecForge's draft alone out of an earlier recipe session's drafts.tar (`node drafts K`'s
    parts joined: the best of our variants and SpecForge's), unpacked as dest/specforge/draft,
    which it returns; refused, naming the file, unless it holds that draft's config.json and
    model.safetensors. A recipe plan given it gates and replays that draft beside this session's
    variants instead of training SpecForge's again: the same sequences and batches (a carried
    generation, the seed), so the comparison is the one its own session made."""
    with tarfile.open(packed) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(f"{ANCHOR_MEMBER}/")]
        missing = sorted({f"{ANCHOR_MEMBER}/config.json", f"{ANCHOR_MEMBER}/model.safetensors"} - {m.name for m in members})
        if missing:
            raise ValueError(f"{packed}: no {', '.join(missing)} in it: not a recipe plan's drafts with SpecForge's")
        for member in members:
            member.name = "specforge/draft/" + member.name.removeprefix(f"{ANCHOR_MEMBER}/")
            tar.extract(member, dest, filter="data")
    return dest / "specforge/draft"


def carried_anchor() -> Path | None:
    """SpecForge's draft this node's payload carried (`prepare --anchor-from`), or None."""
    path = node_env.NODE / CARRIED_ANCHOR
    return path if (path / "config.json").is_file() else None


# The draft a node's training starts from (`prepare --start-from`: train.init_from), beside the run.
START_DRAFT = "src/start-draft"
_FINAL = "run/train/final/"


def unpack_start_draft(packed: Path, dest: Path) -> Path:
    """An earlier session's exported draft out of its drafts.tar (`node drafts K`'s parts joined:
    run/train/final/), unpacked as dest/start-draft, which it returns; refused, naming the file,
    unless it holds the draft's config.json and model.safetensors. A node given it trains its
    draft from those weights (train.init_from) instead of random ones, the same start in every
    session of that draft: a checkpoint records the start it was trained from."""
    with tarfile.open(packed) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(_FINAL)]
        missing = sorted({f"{_FINAL}config.json", f"{_FINAL}model.safetensors"} - {m.name for m in members})
        if missing:
            raise ValueError(f"{packed}: no {', '.join(missing)} in it: not the drafts.tar of a session that trained one")
        for member in members:
            member.name = "start-draft/" + member.name.removeprefix(_FINAL)
            tar.extract(member, dest, filter="data")
    return dest / "start-draft"


def carried_start_draft() -> Path | None:
    """The draft this node's payload carried to start training from (`prepare --start-from`), or None."""
    path = node_env.NODE / START_DRAFT
    return path if (path / "config.json").is_file() else None


def _unpack(packed: Path, dest: Path, under: str, not_ours: str, required: str | tuple[str, ...], incomplete: str,
            check: Callable[[tarfile.TarFile, set[str]], None] | None = None) -> None:  # fmt: skip
    """`packed` extracted into dest, once every member lies under `under`, `required` is among
    them (or, given several, one of them: a name ending in / is a folder with members) and
    `check` (given the tar and its member names) raises nothing; else ValueError naming the file
    and what is wrong, with nothing extracted."""
    with tarfile.open(packed) as tar:
        names = tar.getnames()
        outside = [n for n in names if not (n + "/").startswith(under)]
        if outside:
            raise ValueError(f"{packed}: members outside {under} ({outside[:3]}): {not_ours}")
        wanted = (required,) if isinstance(required, str) else required
        if not any(any(n.startswith(w) for n in names) if w.endswith("/") else w in names for w in wanted):
            raise ValueError(f"{packed}: no {' or '.join(wanted)} in it: {incomplete}")
        if check is not None:
            check(tar, set(names))
        tar.extractall(dest, filter="data")
