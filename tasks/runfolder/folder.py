"""A run root on any fsspec filesystem: local folder by default, s3://bucket/prefix in production.

Local writes go through a temp file + fsync + os.replace; object stores get one PUT per object,
which is atomic there. Either way a reader never sees a partial object.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tasks.errors import ExpectedFailure

TMP_PREFIX = ".tmp-"
# A temp file untouched this long belongs to no live write: a writer rewrites its temp's mtime
# with every chunk and renames it right after one fsync, which a minute covers on a slow disk.
# Younger ones may be another worker's write in flight on a shared folder, and are spared.
STRAY_TEMP_AGE_S = 60.0

# Writes that fail with these fail again at once: a retry in seconds or minutes cannot heal a
# read-only mount, a full disk or a refused permission (the operator must act).
_UNWRITABLE = {
    errno.EROFS: ("is read-only", "mount it read-write or give another --run-root"),
    errno.ENOSPC: ("is full", "free space there"),
    errno.EDQUOT: ("is over its disk quota", "free space there or raise the quota"),
    errno.EACCES: ("refuses writes (permission denied)", "give this user write access"),
    errno.EPERM: ("refuses writes (operation not permitted)", "give this user write access"),
}


class RunRootUnwritable(RuntimeError, ExpectedFailure):
    """The run root refuses writes (read-only, full, not permitted): no retry heals that."""


def unwritable(exc: BaseException) -> bool:
    """Whether `exc` is a refused write that retrying cannot heal."""
    return isinstance(exc, RunRootUnwritable) or (isinstance(exc, OSError) and exc.errno in _UNWRITABLE)


def unwritable_error(url: str, exc: OSError) -> RunRootUnwritable:
    """The one message for a refused write to the run root `url`: what, where, and the fix."""
    what, fix = _UNWRITABLE.get(exc.errno or 0, ("refuses writes", "make it writable"))
    where = f" ({exc.filename})" if exc.filename else ""
    return RunRootUnwritable(
        f"run root {url} {what}: {exc.strerror or exc}{where}. Results written so far are kept; "
        f"{fix}, then rerun the same command to resume"
    )


def check_writable(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Write and remove a small object in the run root: RunRootUnwritable when refused, so a
    read-only or full run root is named before anything starts."""
    try:
        run = RunFolder(url, storage_options)
        probe = tmp_name("writable")
        run.write_bytes_atomic(probe, b"")
        run.remove(probe)
    except OSError as e:
        if e.errno in _UNWRITABLE:
            raise unwritable_error(url, e) from None
        raise


def tmp_name(base: str) -> str:
    return f"{TMP_PREFIX}{secrets.token_hex(6)}-{base}"


class RunFolder:
    """One run root. All paths given to its methods are relative keys like 'generate/data/x'."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"RunFolder({self.url!r})"

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel.strip('/')}" if rel else self.root

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def read_json(self, rel: str) -> Any | None:
        try:
            return json.loads(self.read_bytes(rel))
        except FileNotFoundError:
            return None

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        target = self.path(rel)
        if not self.is_local:
            self.fs.pipe_file(target, data)
            return
        os.replace(_durable_temp(target, data), target)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Write `data` only if nothing is at `rel`. True when this call created it.

        Local: link a complete temp file into place (link fails if the name exists). S3:
        a conditional PUT (If-None-Match: *); where the store ignores the condition, a
        read-back decides who won, so exactly one writer still sees True.
        """
        target = self.path(rel)
        if self.is_local:
            tmp = _durable_temp(target, data)
            try:
                os.link(tmp, target)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if self.fs.exists(target):
            return False
        try:
            self.fs.pipe_file(target, data, mode="create")
        except (FileExistsError, OSError):
            return False
        self.fs.invalidate_cache(target)
        return self.fs.cat_file(target) == data

    def write_json_atomic(self, rel: str, obj: Any) -> None:
        self.write_bytes_atomic(rel, json_bytes(obj))

    def listdir(self, rel: str) -> list[str]:
        """Base names under `rel` (files and folders), sorted; [] when it does not exist."""
        full = self.path(rel)
        self.fs.invalidate_cache(full)
        try:
            entries = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def info(self, rel: str) -> dict[str, Any]:
        return self.fs.info(self.path(rel))

    def remove(self, rel: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=recursive)

    def remove_stray_temps(self, min_age_s: float = STRAY_TEMP_AGE_S) -> list[str]:
        """Remove the temp files and folders (`.tmp-*`) anywhere under a local run root that
        no write is using any more (a kill -9 mid-write); returns their keys. An object store
        gets no temps (one PUT per object), so there is nothing to remove there."""
        if not self.is_local:
            return []
        removed, cutoff = [], time.time() - min_age_s
        for folder, dirs, files in os.walk(self.root):
            for name in [n for n in (*dirs, *files) if n.startswith(TMP_PREFIX)]:
                path = os.path.join(folder, name)
                try:
                    if os.lstat(path).st_mtime > cutoff:
                        continue
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
                except FileNotFoundError:  # renamed into place or removed meanwhile
                    continue
                removed.append(os.path.relpath(path, self.root))
            dirs[:] = [d for d in dirs if not d.startswith(TMP_PREFIX)]
        return sorted(removed)


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode()


def _durable_temp(target: str, data: bytes) -> str:
    """`data` in a fsynced temp file beside local `target` (same folder, so a rename or link
    into place is atomic); returns the temp file's path."""
    parent, base = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, tmp_name(base))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk, a kill: no half-written temp stays behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp
