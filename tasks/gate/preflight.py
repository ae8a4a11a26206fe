"""Checks of the draft folder against the launch, before any server starts (docs/DESIGN.md §7).

SGLang loads a mismatched EAGLE-3 draft without complaint and then accepts ~1 token per step;
these guards name the mismatch instead. Shapes come from the safetensors headers (8-byte
length + JSON), so a multi-GB draft is not read, and the folder may be local or on s3://.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import fsspec

from tasks.errors import ExpectedFailure
from tasks.extract.capture import aux_capture_layers
from tasks.sglang.command import SpecParams
from tasks.target.model_dir import text_config

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024


class PreflightError(ValueError, ExpectedFailure):
    """One or more guards failed; the message lists each problem."""

    def __init__(self, where: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"preflight of {where} failed:\n- " + "\n- ".join(problems))


@dataclass
class PreflightReport:
    draft_dir: str
    checks: dict[str, str] = field(default_factory=dict)  # name -> "ok" or the problem
    problems: list[str] = field(default_factory=list)

    def record(self, name: str, problem: str | None) -> None:
        self.checks[name] = problem or "ok"
        if problem:
            self.problems.append(problem)


def read_safetensors_header(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, dict[str, Any]]:
    """{tensor name: {"dtype", "shape"}} from a safetensors file's header alone."""
    with fs.open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise PreflightError(path, [f"{path}: not a safetensors file (shorter than 8 bytes)"])
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise PreflightError(path, [f"{path}: safetensors header claims {n} bytes; not a safetensors file"])
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise PreflightError(path, [f"{path}: unreadable safetensors header: {e}"]) from None
    return {k: v for k, v in header.items() if k != "__metadata__"}


def draft_tensor_shapes(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, list[int]]:
    """Shapes of the draft's tensors, following model.safetensors.index.json when sharded."""
    files = [f"{root}/{WEIGHTS}"]
    if fs.exists(f"{root}/{INDEX}"):
        index = json.loads(fs.cat_file(f"{root}/{INDEX}"))
        files = sorted({f"{root}/{name}" for name in index.get("weight_map", {}).values()})
    elif not fs.exists(files[0]):
        raise PreflightError(root, [f"{root}: no {WEIGHTS} or {INDEX} in the draft folder"])
    shapes = {}
    for path in files:
        shapes.update({k: list(v["shape"]) for k, v in read_safetensors_header(fs, path).items()})
    return shapes


def _draft_tokens_problem(spec: SpecParams) -> str | None:
    if spec.topk == 1 and spec.num_draft_tokens != spec.num_steps + 1:
        return (
            f"{spec.label}: topk=1 needs num_draft_tokens = num_steps + 1 = {spec.num_steps + 1}, "
            f"got {spec.num_draft_tokens} (SGLang would silently force {spec.num_steps + 1})"
        )
    return None


def _algorithm_problem(config: dict[str, Any], algorithm: str) -> str | None:
    archs = config.get("architectures") or []
    eagle3 = any("eagle3" in str(a).lower() for a in archs)
    if eagle3 and algorithm != "EAGLE3":
        return (
            f"draft architectures {archs} name an EAGLE-3 draft but --speculative-algorithm is "
            f"{algorithm!r}: SGLang would skip the draft's fc layer and acceptance would stay at "
            f"~1.0 with no error; use --speculative-algorithm EAGLE3"
        )
    if not eagle3 and algorithm == "EAGLE3":
        return f"--speculative-algorithm EAGLE3 needs an EAGLE-3 draft, but its architectures are {archs}"
    return None


def _check_draft(
    report: PreflightReport,
    config: dict[str, Any],
    shapes: dict[str, list[int]],
    target: dict[str, Any],
    aux_layer_ids: list[int] | None,
) -> None:
    hidden, vocab, layers = int(target["hidden_size"]), int(target["vocab_size"]), int(target["num_hidden_layers"])
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    model_type = str(target.get("model_type", "llama"))
    draft_ids = list(ids) if ids is not None else aux_capture_layers(model_type, layers)
    where = "eagle_config.eagle_aux_hidden_state_layer_ids" if ids is not None else "SGLang's default aux layer ids"

    fc = shapes.get("fc.weight")
    expect_in = hidden * len(draft_ids)
    if fc is None:
        report.record("fc_width", "the draft has no fc.weight (not an EAGLE-3 draft checkpoint)")
    elif len(fc) != 2 or fc[1] != expect_in:
        report.record(
            "fc_width",
            f"fc.weight is {fc}: in-features {fc[-1]} != target hidden_size {hidden} x "
            f"{len(draft_ids)} aux layers = {expect_in}",
        )
    elif fc[0] != int(config.get("hidden_size", hidden)):
        report.record("fc_width", f"fc.weight is {fc}: out-features {fc[0]} != draft hidden_size {config.get('hidden_size')}")
    else:
        report.record("fc_width", None)

    problem = None
    if any(not 0 <= int(i) < layers for i in draft_ids):
        problem = f"{where} {draft_ids} name layers outside the target's 0..{layers - 1}"
    elif aux_layer_ids is not None and draft_ids != list(aux_layer_ids):
        problem = (
            f"{where} {draft_ids} differ from the extraction's aux layer ids {list(aux_layer_ids)} "
            f"(output-of-layer convention): SGLang would feed the draft other hidden states than it was trained on"
        )
    report.record("aux_layer_ids", problem)

    problems = []
    if int(config.get("vocab_size", -1)) != vocab:
        problems.append(f"draft vocab_size {config.get('vocab_size')} != target vocab_size {vocab}")
    draft_vocab = int(config.get("draft_vocab_size") or config.get("vocab_size") or -1)
    lm_head = shapes.get("lm_head.weight")
    if lm_head is None or lm_head[0] != draft_vocab:
        problems.append(f"draft_vocab_size {draft_vocab} != lm_head.weight rows ({lm_head[0] if lm_head else 'missing'})")
    d2t = shapes.get("d2t")
    if d2t is None and draft_vocab != vocab:
        problems.append(f"the draft has no d2t but its draft_vocab_size {draft_vocab} != vocab_size {vocab}")
    elif d2t is not None and d2t != [draft_vocab]:
        problems.append(f"draft_vocab_size {draft_vocab} != len(d2t) {d2t}")
    t2d = shapes.get("t2d")
    if t2d is not None and t2d != [vocab]:
        problems.append(f"t2d has shape {t2d}, expected [{vocab}] (the target vocab)")
    report.record("vocab", "; ".join(problems) or None)

    th = config.get("target_hidden_size")
    report.record(
        "target_hidden_size",
        None if th is None or int(th) == hidden else f"draft target_hidden_size {th} != target hidden_size {hidden}",
    )


def preflight_sweep(
    draft_dir: str,
    specs: list[SpecParams],
    target_config: dict[str, Any],
    aux_layer_ids: list[int] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    raise_on_problem: bool = True,
) -> PreflightReport:
    """Check the draft once and every speculative config of the sweep; raise PreflightError
    listing all problems (or return them in the report with raise_on_problem=False)."""
    fs, root = fsspec.core.url_to_fs(draft_dir, **(storage_options or {}))
    root = root.rstrip("/")
    report = PreflightReport(draft_dir)
    try:
        config = json.loads(fs.cat_file(f"{root}/{CONFIG}"))
    except FileNotFoundError:
        raise PreflightError(draft_dir, [f"{draft_dir}: no {CONFIG} in the draft folder"]) from None
    except ValueError as e:
        raise PreflightError(draft_dir, [f"{draft_dir}/{CONFIG}: not valid JSON: {e}"]) from None
    if not isinstance(config, dict):
        raise PreflightError(draft_dir, [f"{draft_dir}/{CONFIG}: expected a JSON object"])
    target = text_config(target_config)
    missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if k not in target]
    if missing:
        raise PreflightError(draft_dir, [f"target config lacks {missing}"])
    for algorithm in sorted({s.algorithm for s in specs}):
        report.record(f"algorithm:{algorithm}", _algorithm_problem(config, algorithm))
    _check_draft(report, config, draft_tensor_shapes(fs, root), target, aux_layer_ids)
    for spec in specs:
        report.record(f"draft_tokens:{spec.label}", _draft_tokens_problem(spec))
    if report.problems and raise_on_problem:
        raise PreflightError(draft_dir, report.problems)
    return report


def preflight(
    draft_dir: str,
    spec: SpecParams,
    target_config: dict[str, Any],
    aux_layer_ids: list[int] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> PreflightReport:
    """The guards for one launch (see preflight_sweep)."""
    return preflight_sweep(draft_dir, [spec], target_config, aux_layer_ids, storage_options=storage_options)
