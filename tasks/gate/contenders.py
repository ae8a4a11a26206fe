"""The drafts the gate measures beside the run's own and compares it with (docs/GATE.md): the
incumbent (the registry's promoted draft for the same target) and the named challengers
(gate.challengers). Each is found, copied to the node when it is remote (servers read local
folders) and preflight-checked before any launch. One that cannot be measured is left out with
the reason, never fatal: only the run's own draft can stop the gate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tasks.gate.plan import (
    CHALLENGER,
    INCUMBENT,
    ExtraDraft,
    Incumbent,
    LeftOut,
    SweepPoint,
    sweep_points,
)
from tasks.gate.preflight import PreflightError, preflight_sweep
from tasks.gate.promote import POINTER
from tasks.runfolder import RunFolder
from tasks.runfolder.fingerprint import RUN_JSON
from tasks.sglang.command import LaunchError, SpecParams, resolve_spec

if TYPE_CHECKING:
    from tasks.config import EagleScaleConfig

log = logging.getLogger(__name__)

CHALLENGER_PREFIX = "challenger-"  # a challenger's contender name: never "incumbent" or "new draft"


@dataclass
class Contenders:
    drafts: list[ExtraDraft] = field(default_factory=list)  # one per config to benchmark
    incumbent: Incumbent | None = None
    left_out: list[LeftOut] = field(default_factory=list)


def run_target(run: RunFolder) -> dict[str, Any] | None:
    """The target identity the run's data was generated with (run.json's fingerprint)."""
    recorded = run.read_json(RUN_JSON)
    return (recorded or {}).get("fingerprint", {}).get("target")


def same_target(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two target identities name one model. Where it was read from (model_path) differs
    between nodes and checkouts, so it counts only when the revision is a name (a hub revision)
    rather than the weights' own digest."""
    if not a or not b:
        return False
    keys = (set(a) | set(b)) - {"model_path"}
    if not str(a.get("revision", "")).startswith("sha256:"):
        keys.add("model_path")
    return all(a.get(k) == b.get(k) for k in keys)


def local_draft(url: str, storage_options: dict[str, Any], dest: Path) -> Path:
    """A folder the servers can read: a local one as it is (a draft may be gigabytes), a remote
    one (s3://...) copied into `dest`. FileNotFoundError names the url when it holds no file."""
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    if isinstance(fs, LocalFileSystem):
        if not Path(root).is_dir():
            raise FileNotFoundError(f"no draft folder at {url}")
        return Path(root)
    root = root.rstrip("/")
    files = fs.find(root)
    if not files:
        raise FileNotFoundError(f"no draft folder at {url} (nothing under it)")
    for path in files:  # streamed: a production draft's weights are gigabytes
        target = dest / path[len(root) :].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(target))
    return dest


def _checked(name: str, role: str, where: str, points: list[SweepPoint], local: Path,
             target_config: dict[str, Any]) -> tuple[list[ExtraDraft], str | None]:  # fmt: skip
    """The ExtraDrafts of one contender, or the reason it is left out: its configs must resolve
    and the folder must pass preflight for every one of them."""
    try:
        specs: list[SpecParams] = [resolve_spec(str(local), s, k, n)[0] for s, k, n in points]
        # No aux-layer check against this run's extraction: a draft trained elsewhere carries its
        # own eagle_config, which SGLang follows; the checks of shapes and range still apply.
        preflight_sweep(str(local), specs, target_config, None)
    except (PreflightError, LaunchError) as e:
        return [], f"{where}: {e}"
    return [ExtraDraft(name, str(local), s, k, n, role=role) for s, k, n in points], None


def find_incumbent(
    config: EagleScaleConfig, run: RunFolder, work_dir: Path, draft_sha: dict[str, str], target_config: dict[str, Any]
) -> tuple[list[ExtraDraft], Incumbent | None, LeftOut | None]:
    """The registry's promoted draft, when it is for this run's target and is not this very draft,
    at the configs gate.incumbent says. `draft_sha`: the run's draft, {file: sha256}."""
    gate = config.gate
    if gate.incumbent == "off" or not gate.registry_url:
        return [], None, None
    record = RunFolder(gate.registry_url, gate.registry_storage_options).read_json(POINTER)
    if not record:
        return [], None, None
    draft_id, uri = str(record.get("draft_id")), str(record.get("uri"))

    def out(reason: str) -> tuple[list[ExtraDraft], None, LeftOut]:
        log.warning("gate: the incumbent %s is not benchmarked: %s", draft_id, reason)
        return [], None, LeftOut(INCUMBENT, INCUMBENT, uri, reason)

    mine = run_target(run)
    if mine is None:
        return out(f"this run records no target identity ({RUN_JSON}): the registry's draft {draft_id} cannot be matched to it")
    if not same_target(record.get("target"), mine):
        recorded = "records no target identity" if not record.get("target") else "was promoted for another target"
        return out(f"the registry's draft {draft_id} {recorded} (this run's: {mine.get('model_path') or mine.get('revision')}); not an incumbent of this target")
    if {k: v["sha256"] for k, v in record.get("files", {}).items()} == draft_sha:
        return out(f"the registry already points at this run's draft ({draft_id}, the same files)")
    if gate.engine == "local":
        return out("the local engine measures the run's own draft only (gate.engine sglang or emulated measures the incumbent)")
    spec = (record.get("evidence") or {}).get("best_spec")
    if gate.incumbent == "evidence" and spec:
        points, source = [(spec["num_steps"], spec["topk"], spec["num_draft_tokens"])], "evidence"
    else:
        points = sweep_points(gate)
        source = "sweep" if gate.incumbent == "sweep" else "sweep (its evidence names no best config)"
    try:
        local = local_draft(uri, gate.registry_storage_options, work_dir / "incumbent")
    except (FileNotFoundError, OSError) as e:
        return out(f"{uri}: {e}")
    drafts, problem = _checked(INCUMBENT, INCUMBENT, f"the incumbent {draft_id}", points, local, target_config)
    if problem:
        return out(problem)
    return drafts, Incumbent(draft_id, uri, source, record), None


def find_challengers(config: EagleScaleConfig, work_dir: Path, target_config: dict[str, Any]) -> tuple[list[ExtraDraft], list[LeftOut]]:
    """gate.challengers, each at its config; one missing or failing preflight is left out."""
    drafts: list[ExtraDraft] = []
    left_out: list[LeftOut] = []
    for c in config.gate.challengers:
        name = f"{CHALLENGER_PREFIX}{c.name}"
        where = f"gate.challengers {c.name} ({c.path})"
        try:
            local = local_draft(c.path, config.storage_options, work_dir / name)
        except (FileNotFoundError, OSError) as e:
            left_out.append(LeftOut(name, CHALLENGER, c.path, f"{where}: {e}"))
            continue
        mine, problem = _checked(name, CHALLENGER, where, [(c.num_steps, c.topk, c.num_draft_tokens)], local, target_config)
        if problem:
            left_out.append(LeftOut(name, CHALLENGER, c.path, problem))
        drafts += mine
    for x in left_out:
        log.warning("gate: challenger left out: %s", x.reason)
    return drafts, left_out


def find_contenders(
    config: EagleScaleConfig, run: RunFolder, work_dir: Path, draft_sha: dict[str, str], target_config: dict[str, Any]
) -> Contenders:
    inc_drafts, incumbent, inc_out = find_incumbent(config, run, work_dir, draft_sha, target_config)
    ch_drafts, ch_out = find_challengers(config, work_dir, target_config)
    return Contenders(inc_drafts + ch_drafts, incumbent, ([inc_out] if inc_out else []) + ch_out)
