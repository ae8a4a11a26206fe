"""Preflight guards: each fires on a crafted bad draft or launch with a message naming the problem."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tasks.gate.preflight import PreflightError, draft_tensor_shapes, preflight, preflight_sweep
from tasks.sglang.command import SpecParams
from tests.gate_support import AUX_IDS, TARGET_CONFIG, draft_config, write_draft

GOOD = SpecParams("unused", num_steps=3, topk=1, num_draft_tokens=4)


def problems_of(draft: Path, spec: SpecParams = GOOD, aux: list[int] | None = AUX_IDS,
                target: dict | None = None) -> list[str]:  # fmt: skip
    with pytest.raises(PreflightError) as err:
        preflight(str(draft), spec, target or TARGET_CONFIG, aux)
    assert str(err.value).startswith(f"preflight of {draft} failed:")
    return err.value.problems


def test_a_good_draft_passes_every_check(tmp_path: Path) -> None:
    draft = write_draft(tmp_path / "draft")
    tree = SpecParams("unused", num_steps=3, topk=4, num_draft_tokens=8)
    report = preflight_sweep(str(draft), [GOOD, tree], TARGET_CONFIG, AUX_IDS)
    assert report.problems == []
    assert set(report.checks) == {
        "algorithm:EAGLE3", "fc_width", "aux_layer_ids", "vocab", "target_hidden_size",
        "draft_tokens:eagle3-s3-k1-n4", "draft_tokens:eagle3-s3-k4-n8",
    }  # fmt: skip
    assert set(report.checks.values()) == {"ok"}


def test_eagle_algorithm_with_an_eagle3_draft(tmp_path: Path) -> None:
    draft = write_draft(tmp_path / "draft")
    problems = problems_of(draft, SpecParams("unused", 3, 1, 4, algorithm="EAGLE"))
    assert problems == [
        "draft architectures ['LlamaForCausalLMEagle3'] name an EAGLE-3 draft but --speculative-algorithm "
        "is 'EAGLE': SGLang would skip the draft's fc layer and acceptance would stay at ~1.0 with no "
        "error; use --speculative-algorithm EAGLE3"
    ]
    plain = write_draft(tmp_path / "plain", draft_config(architectures=["LlamaForCausalLM"]))
    assert problems_of(plain) == [
        "--speculative-algorithm EAGLE3 needs an EAGLE-3 draft, but its architectures are ['LlamaForCausalLM']"
    ]


def test_wrong_fc_width(tmp_path: Path) -> None:
    draft = write_draft(tmp_path / "draft", fc_in=64)  # the EAGLE (final-hidden-state) width
    assert problems_of(draft) == [
        "fc.weight is [64, 64]: in-features 64 != target hidden_size 64 x 3 aux layers = 192"
    ]
    bigger_target = {**TARGET_CONFIG, "hidden_size": 128}
    problems = problems_of(write_draft(tmp_path / "d2"), target=bigger_target)
    assert "fc.weight is [64, 192]: in-features 192 != target hidden_size 128 x 3 aux layers = 384" in problems
    assert "draft target_hidden_size 64 != target hidden_size 128" in problems


def test_aux_layer_ids_inconsistent_with_the_extraction(tmp_path: Path) -> None:
    draft = write_draft(tmp_path / "draft")
    problems = problems_of(draft, aux=[2, 4, 5])  # the input-of-layer convention: off by one
    assert problems == [
        "eagle_config.eagle_aux_hidden_state_layer_ids [1, 3, 4] differ from the extraction's aux layer "
        "ids [2, 4, 5] (output-of-layer convention): SGLang would feed the draft other hidden states "
        "than it was trained on"
    ]
    out_of_range = draft_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 8]})
    assert problems_of(write_draft(tmp_path / "d2", out_of_range), aux=None) == [
        "eagle_config.eagle_aux_hidden_state_layer_ids [1, 3, 8] name layers outside the target's 0..7"
    ]


def test_vocab_mismatches(tmp_path: Path) -> None:
    wrong_vocab = write_draft(tmp_path / "v", draft_config(vocab_size=4096))
    assert "draft vocab_size 4096 != target vocab_size 2048" in problems_of(wrong_vocab)[0]
    lm = write_draft(tmp_path / "lm", lm_rows=200)
    assert problems_of(lm) == ["draft_vocab_size 256 != lm_head.weight rows (200)"]
    d2t = write_draft(tmp_path / "d2t", d2t_len=255)
    assert problems_of(d2t) == ["draft_vocab_size 256 != len(d2t) [255]"]


def test_topk1_needs_steps_plus_one_draft_tokens(tmp_path: Path) -> None:
    draft = write_draft(tmp_path / "draft")
    assert problems_of(draft, SpecParams("unused", 3, 1, 6)) == [
        "eagle3-s3-k1-n6: topk=1 needs num_draft_tokens = num_steps + 1 = 4, got 6 (SGLang would "
        "silently force 4)"
    ]


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match="no config.json in the draft folder"):
        preflight(str(tmp_path), GOOD, TARGET_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(draft_config()))
    with pytest.raises(PreflightError, match="no model.safetensors or model.safetensors.index.json"):
        preflight(str(tmp_path), GOOD, TARGET_CONFIG)


def test_shapes_come_from_headers_alone_and_follow_the_index(tmp_path: Path) -> None:
    """A header promising 1 GB of tensors with no data after it still gives its shapes, and a
    sharded draft is read through its index."""
    header = json.dumps({"fc.weight": {"dtype": "BF16", "shape": [7168, 21504], "data_offsets": [0, 308281344]},
                         "__metadata__": {"format": "pt"}}).encode()  # fmt: skip
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    header2 = json.dumps({"lm_head.weight": {"dtype": "BF16", "shape": [32000, 7168], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(struct.pack("<Q", len(header2)) + header2)
    index = {"weight_map": {"fc.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    from fsspec.implementations.local import LocalFileSystem

    assert draft_tensor_shapes(LocalFileSystem(), str(tmp_path)) == {
        "fc.weight": [7168, 21504],
        "lm_head.weight": [32000, 7168],
    }
