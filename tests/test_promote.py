"""Promotion: the registry gets a verified copy and promoted.json; a reject keeps the previous draft."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tasks.gate.decision import GateDecision
from tasks.gate.promote import PromotionError, draft_files, promote, publish_draft
from tasks.runfolder import RunFolder
from tests.gate_support import draft_config, write_draft
from tests.s3_support import moto_s3


def decision(outcome: str, reason: str) -> GateDecision:
    promoted = outcome == "promote"
    return GateDecision(outcome, "eagle3-s3-k1-n4" if promoted else None, "baseline", 1.8 if promoted else None,
                        1.7 if promoted else None, 1.9 if promoted else None, 0.95, [reason], [], {})  # fmt: skip


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_promote_publishes_and_records_the_previous_draft(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    run1, run2 = RunFolder(str(tmp_path / "run-a")), RunFolder(str(tmp_path / "run-b"))
    draft1 = write_draft(tmp_path / "run-a/train/final")
    draft2 = write_draft(tmp_path / "run-b/train/final", draft_config(rms_norm_eps=1e-5))

    first = promote(run1, decision("promote", "faster"), str(draft1), str(registry))
    assert first["promoted"] is True and first["previous_draft"] is None
    draft_id = first["draft_id"]
    assert draft_id.startswith("run-a-") and len(draft_id) == len("run-a-") + 12
    copied = registry / "drafts" / draft_id
    assert sorted(p.name for p in copied.iterdir()) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert sha(copied / name) == sha(draft1 / name)
    pointer = json.loads((registry / "promoted.json").read_text())
    assert pointer == json.loads(Path(run1.path("promoted.json")).read_text())
    assert set(pointer) == {"draft_id", "uri", "files", "promoted_at", "run_root", "source", "evidence", "previous",
                            "target", "replaced"}  # fmt: skip
    assert pointer["target"] is None and pointer["replaced"] is None  # no target given, no incumbent measured
    assert pointer["files"]["model.safetensors"]["sha256"] == sha(draft1 / "model.safetensors")
    assert pointer["evidence"]["speedup"] == 1.8 and pointer["evidence"]["outcome"] == "promote"
    assert len(list((registry / "history").iterdir())) == 1

    second = promote(run2, decision("promote", "faster again"), str(draft2), str(registry))
    assert second["draft_id"] != draft_id
    assert second["previous_draft"]["draft_id"] == draft_id
    pointer = json.loads((registry / "promoted.json").read_text())
    assert pointer["draft_id"] == second["draft_id"] and pointer["previous"]["draft_id"] == draft_id
    assert (copied / "model.safetensors").exists()  # the previous draft stays published
    assert len(list((registry / "history").iterdir())) == 2

    again = promote(run2, decision("promote", "same draft"), str(draft2), str(registry))
    assert again["draft_id"] == second["draft_id"]
    assert again["previous_draft"]["draft_id"] == draft_id  # not itself


def test_reject_keeps_the_previous_draft_and_says_why(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    old_run = RunFolder(str(tmp_path / "old"))
    promote(old_run, decision("promote", "faster"), str(write_draft(tmp_path / "old/final")), str(registry))
    before = {p: p.read_bytes() for p in registry.rglob("*") if p.is_file()}

    run = RunFolder(str(tmp_path / "new"))
    reason = "slower than the baseline: eagle3-s3-k1-n4: median 70.0 tok/s, speedup 0.700x"
    out = promote(run, decision("reject", reason), str(write_draft(tmp_path / "new/final")), str(registry))
    assert out["promoted"] is False
    previous_id = before[registry / "promoted.json"] and json.loads(before[registry / "promoted.json"])["draft_id"]
    assert out["previous_draft"]["draft_id"] == previous_id
    assert out["message"] == f"reject: kept the previous draft ({previous_id}): {reason}"
    assert {p: p.read_bytes() for p in registry.rglob("*") if p.is_file()} == before
    assert not run.exists("promoted.json")

    first_ever = promote(RunFolder(str(tmp_path / "x")), decision("stopped", "acceptance stuck at 1.0"),
                         str(tmp_path / "x/final"), str(tmp_path / "empty-registry"))  # fmt: skip
    assert first_ever["message"] == "stopped: kept the previous draft (none promoted yet): acceptance stuck at 1.0"


def test_a_copy_that_does_not_verify_is_refused(tmp_path: Path) -> None:
    draft = write_draft(tmp_path / "draft")
    from fsspec.implementations.local import LocalFileSystem

    files = draft_files(LocalFileSystem(), str(draft))
    files["config.json"] = {**files["config.json"], "sha256": "0" * 64}
    registry = RunFolder(str(tmp_path / "registry"))
    with pytest.raises(PromotionError, match=r"drafts/d1/config.json: copy does not verify \(sha256 [0-9a-f]{12}"):
        publish_draft(str(draft), registry, "d1", files)
    assert not registry.exists("promoted.json")
    with pytest.raises(PromotionError, match="no config.json; not an SGLang draft folder"):
        draft_files(LocalFileSystem(), str(tmp_path / "registry"))


def test_no_registry_configured(tmp_path: Path) -> None:
    run = RunFolder(str(tmp_path / "run"))
    draft = write_draft(tmp_path / "run/train/final")
    out = promote(run, decision("promote", "faster"), str(draft), None)
    assert out["promoted"] is True and out["uri"] == str(draft)
    assert "no registry configured" in out["message"]
    assert json.loads(Path(run.path("promoted.json")).read_text())["uri"] == str(draft)


def test_promote_to_an_s3_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    draft = write_draft(tmp_path / "run/train/final")
    run = RunFolder(str(tmp_path / "run"))
    with moto_s3(monkeypatch) as s3:
        url = f"s3://{s3['bucket']}/drafts-registry"
        out = promote(run, decision("promote", "faster"), str(draft), url,
                      registry_storage_options=s3["storage_options"])  # fmt: skip
        registry = RunFolder(url, s3["storage_options"])
        pointer = registry.read_json("promoted.json")
        assert pointer["uri"] == f"{url}/drafts/{out['draft_id']}"
        body = registry.read_bytes(f"drafts/{out['draft_id']}/model.safetensors")
        assert hashlib.sha256(body).hexdigest() == sha(draft / "model.safetensors")
        assert len(registry.listdir("history")) == 1
