"""run.json: what a run is, so a resume with different inputs is refused instead of mixed.

Keys are content hashes: request ids hash the fingerprint recorded when the run started, so
the order of input never matters and a resume finds exactly the same keys.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from tasks.errors import ExpectedFailure
from tasks.runfolder.folder import RunFolder

RUN_JSON = "run.json"


class FingerprintMismatch(RuntimeError, ExpectedFailure):
    """A resume whose inputs differ from the run's; the message names each differing field."""


def canonical_json(obj: Any) -> str:
    """The one serialization that everything hashed is hashed in (prompt ids, request ids,
    run.json, markers): sorted keys, compact, UTF-8 not \\u-escaped; non-JSON values as str."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def content_hash(obj: Any, length: int = 20) -> str:
    data = obj if isinstance(obj, bytes) else canonical_json(obj).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def fingerprint_hash(fingerprint: dict[str, Any]) -> str:
    return content_hash(fingerprint, 16)


def request_id(fp_hash: str, prompt_id: str, sample_index: int) -> str:
    return hashlib.sha256(f"{fp_hash}:{prompt_id}:{sample_index}".encode()).hexdigest()[:24]


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted keys: {'a': {'b': 1}} -> {'a.b': 1}."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def diff_fingerprints(old: dict[str, Any], new: dict[str, Any], only_common: bool = False) -> list[str]:
    """'field: old -> new' for each differing leaf; `only_common` skips fields one side lacks."""
    a, b = flatten(old), flatten(new)
    keys = (a.keys() & b.keys()) if only_common else (a.keys() | b.keys())
    missing = "<absent>"
    return [
        f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}"
        for k in sorted(keys)
        if a.get(k, missing) != b.get(k, missing)
    ]


def check_fingerprint(
    run: RunFolder, fingerprint: dict[str, Any], allow_change: bool = False, partial: bool = False
) -> None:
    """Refuse early when run.json disagrees on any field given (`partial`: fields given only)."""
    recorded = run.read_json(RUN_JSON)
    if recorded is None:
        return
    diffs = diff_fingerprints(recorded["fingerprint"], fingerprint, only_common=partial)
    if diffs and not allow_change:
        raise FingerprintMismatch(
            f"run folder {run.url} was started with a different fingerprint; refusing to resume "
            f"(pass allow_fingerprint_change to override). Differing fields:\n  "
            + "\n  ".join(diffs)
        )


def ensure_fingerprint(
    run: RunFolder, fingerprint: dict[str, Any], allow_change: bool = False
) -> str:
    """Write run.json on first use, or compare with it. Returns the hash request ids use.

    With `allow_change`, the change is appended to run.json's history and the original hash
    is kept, so already committed work stays addressable.
    """
    recorded = run.read_json(RUN_JSON)
    if recorded is None:
        fp_hash = fingerprint_hash(fingerprint)
        body = {"fingerprint": fingerprint, "fingerprint_hash": fp_hash, "created_at": time.time()}
        if run.create_exclusive(RUN_JSON, canonical_json(body).encode()):
            return fp_hash
        recorded = run.read_json(RUN_JSON)
    check_fingerprint(run, fingerprint, allow_change)
    history = recorded.setdefault("overrides", [])
    # The same override recorded once: with orchestration.overlap the parent flow and the
    # generate flow both ensure the fingerprint.
    repeated = bool(history) and not diff_fingerprints(history[-1]["fingerprint"], fingerprint)
    if diff_fingerprints(recorded["fingerprint"], fingerprint) and not repeated:
        history.append({"at": time.time(), "fingerprint": fingerprint})
        run.write_json_atomic(RUN_JSON, recorded)
    return recorded["fingerprint_hash"]
