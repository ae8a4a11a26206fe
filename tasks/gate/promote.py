"""Publish a promoted draft to the registry, or keep the previous one and say why.

Registry layout (any fsspec URL: a local folder or s3://bucket/prefix):

    <registry>/drafts/<draft_id>/...        the SGLang export folder, copied and sha256-verified
    <registry>/history/<stamp>-<draft_id>.json   every promotion record
    <registry>/promoted.json                 the current draft: written last, so a reader never
                                             sees a pointer to a half-copied folder

The same record goes to <run_root>/promoted.json. draft_id = <run name>-<content hash>, so
promoting the same draft twice copies nothing twice. A record names its target (the run's
target identity, run.json's): a later gate benchmarks it as the incumbent only for the same
target. `replaced` says which incumbent the gate measured it against and by what margin.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import fsspec

from tasks.errors import ExpectedFailure
from tasks.gate.decision import GateDecision
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import PROMOTED

POINTER = PROMOTED
CHUNK = 8 * 1024 * 1024


class PromotionError(RuntimeError, ExpectedFailure):
    """The draft could not be published intact; the registry pointer was not changed."""


def _sha256(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def draft_files(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, dict[str, Any]]:
    """{relative path: {"sha256", "bytes"}} of every file in the draft folder."""
    root = root.rstrip("/")
    files = {}
    for path in sorted(fs.find(root)):
        rel = path[len(root) :].lstrip("/")
        if rel.rsplit("/", 1)[-1].startswith(".tmp-"):
            continue
        sha, size = _sha256(fs, path)
        files[rel] = {"sha256": sha, "bytes": size}
    if "config.json" not in files:
        raise PromotionError(f"{root}: no config.json; not an SGLang draft folder")
    return files


def _copy(src_fs: fsspec.AbstractFileSystem, src: str, dst_fs: fsspec.AbstractFileSystem, dst: str) -> None:
    parent = dst.rsplit("/", 1)[0]
    dst_fs.makedirs(parent, exist_ok=True)
    with src_fs.open(src, "rb") as fi, dst_fs.open(dst, "wb") as fo:
        while chunk := fi.read(CHUNK):
            fo.write(chunk)


def publish_draft(
    draft_dir: str,
    registry: RunFolder,
    draft_id: str,
    files: dict[str, dict[str, Any]],
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Copy the draft's files under drafts/<draft_id>/ and verify each copy's sha256."""
    src_fs, src_root = fsspec.core.url_to_fs(draft_dir, **(storage_options or {}))
    src_root = src_root.rstrip("/")
    for rel, want in files.items():
        dst = registry.path(f"drafts/{draft_id}/{rel}")
        registry.fs.invalidate_cache(dst)
        if registry.fs.exists(dst) and _sha256(registry.fs, dst)[0] == want["sha256"]:
            continue  # already published by an earlier promotion of the same content
        _copy(src_fs, f"{src_root}/{rel}", registry.fs, dst)
        registry.fs.invalidate_cache(dst)
        got, size = _sha256(registry.fs, dst)
        if got != want["sha256"] or size != want["bytes"]:
            raise PromotionError(
                f"{registry.url}/drafts/{draft_id}/{rel}: copy does not verify (sha256 {got[:12]}, "
                f"{size} bytes; expected {want['sha256'][:12]}, {want['bytes']} bytes)"
            )


def _pointer_summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    if not record:
        return None
    return {k: record.get(k) for k in ("draft_id", "uri", "promoted_at", "run_root")}


def _replaced(incumbent: dict[str, Any] | None) -> dict[str, Any] | None:
    """The incumbent this promotion beat, with the margin (None: no incumbent was measured)."""
    if not incumbent or incumbent.get("margin") is None:
        return None
    return {k: incumbent.get(k) for k in ("draft_id", "uri", "config", "median_tok_s", "margin", "ci", "num_steps_from")}


def promote(
    run: RunFolder,
    decision: GateDecision,
    draft_dir: str,
    registry_url: str | None,
    *,
    registry_storage_options: dict[str, Any] | None = None,
    draft_storage_options: dict[str, Any] | None = None,
    target: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Publish on "promote"; otherwise keep the previous draft. Returns the summary for Slack.
    `target`: the target identity the draft was trained for, recorded for later gates."""
    registry = RunFolder(registry_url, registry_storage_options) if registry_url else None
    previous = registry.read_json(POINTER) if registry else run.read_json(POINTER)
    summary: dict[str, Any] = {**decision.summary(), "registry": registry.url if registry else None}
    if not decision.promote:
        kept = _pointer_summary(previous)
        summary.update(promoted=False, previous_draft=kept)
        name = kept["draft_id"] if kept else "none promoted yet"
        summary["message"] = f"{decision.outcome}: kept the previous draft ({name}): " + "; ".join(decision.reasons)
        return summary

    record = publish_record(run, draft_dir, registry, previous, draft_storage_options,
                      evidence=decision.summary(), target=target, replaced=_replaced(decision.incumbent))  # fmt: skip
    where = record["uri"] if registry else f"{draft_dir} (no registry configured: published nowhere else)"
    summary.update(promoted=True, draft_id=record["draft_id"], uri=record["uri"], previous_draft=record["previous"],
                   replaced=record["replaced"])  # fmt: skip
    summary["message"] = f"promoted {record['draft_id']} to {where}: " + "; ".join(decision.reasons)
    return summary


def publish_record(
    run: RunFolder,
    draft_dir: str,
    registry: RunFolder | None,
    previous: dict[str, Any] | None,
    draft_storage_options: dict[str, Any] | None,
    **fields: Any,
) -> dict[str, Any]:
    """Copy the draft into the registry and point promoted.json (the registry's, then the
    run's) at its record; `fields` (evidence, target, replaced, ...) complete the record."""
    src_fs, src_root = fsspec.core.url_to_fs(draft_dir, **(draft_storage_options or {}))
    files = draft_files(src_fs, src_root)
    content = hashlib.sha256("".join(f"{k}:{v['sha256']}\n" for k, v in sorted(files.items())).encode()).hexdigest()
    run_name = re.sub(r"[^A-Za-z0-9._-]+", "-", run.url.rstrip("/").rsplit("/", 1)[-1]) or "run"
    draft_id = f"{run_name}-{content[:12]}"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    prev = _pointer_summary(previous)
    if previous and previous.get("draft_id") == draft_id:
        prev = previous.get("previous")  # promoting the same draft again: keep the real predecessor
    record = {
        "draft_id": draft_id,
        "uri": f"{registry.url}/drafts/{draft_id}" if registry else draft_dir,
        "files": files,
        "promoted_at": stamp,
        "run_root": run.url,
        "source": draft_dir,
        "previous": prev,
        **fields,
    }
    if registry is not None:
        publish_draft(draft_dir, registry, draft_id, files, draft_storage_options)
        registry.write_json_atomic(f"history/{stamp}-{draft_id}.json", record)
        registry.write_json_atomic(POINTER, record)
    run.write_json_atomic(POINTER, record)
    return record
