"""SGLang + speculators export of the EAGLE-3 draft: load-back, names/shapes, refusals, CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from tasks.draft.architecture import DraftConfig
from tasks.draft.export import (
    export_main,
    export_sglang,
    export_speculators,
    export_to_run,
    load_exported,
)
from tasks.draft.export_checks import ExportError
from tasks.draft.model import Eagle3Draft
from tasks.draft.vocab import build_vocab_map
from tasks.runfolder import RunFolder, ShardCommit, ShardStore

H, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, DRAFT_VOCAB = 64, 256, 4, 2, 16, 2048, 256
AUX = [1, 3, 4]  # [1, L//2 - 1, L - 4] for the tiny target's 8 layers

# docs/DESIGN.md §7, written out independently of the exporter's own table.
SGLANG_TABLE = {
    "fc.weight": ([H, 3 * H], torch.float32),
    "midlayer.self_attn.q_proj.weight": ([HEADS * HEAD_DIM, 2 * H], torch.float32),
    "midlayer.self_attn.k_proj.weight": ([KV_HEADS * HEAD_DIM, 2 * H], torch.float32),
    "midlayer.self_attn.v_proj.weight": ([KV_HEADS * HEAD_DIM, 2 * H], torch.float32),
    "midlayer.self_attn.o_proj.weight": ([H, HEADS * HEAD_DIM], torch.float32),
    "midlayer.mlp.gate_proj.weight": ([INTER, H], torch.float32),
    "midlayer.mlp.up_proj.weight": ([INTER, H], torch.float32),
    "midlayer.mlp.down_proj.weight": ([H, INTER], torch.float32),
    "midlayer.hidden_norm.weight": ([H], torch.float32),
    "midlayer.input_layernorm.weight": ([H], torch.float32),
    "midlayer.post_attention_layernorm.weight": ([H], torch.float32),
    "norm.weight": ([H], torch.float32),
    "lm_head.weight": ([DRAFT_VOCAB, H], torch.float32),
    "d2t": ([DRAFT_VOCAB], torch.int64),
    "t2d": ([VOCAB], torch.bool),
}


@pytest.fixture(scope="module")
def target_config(tiny_target_dir: Path) -> dict:
    return json.loads((tiny_target_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def embed(tiny_target_dir: Path) -> torch.Tensor:
    return load_file(str(tiny_target_dir / "model.safetensors"))["model.embed_tokens.weight"]


def make_draft(target_config: dict, embed: torch.Tensor, **overrides) -> Eagle3Draft:
    cfg = DraftConfig.from_target(target_config, draft_vocab_size=DRAFT_VOCAB)
    cfg = dataclasses.replace(cfg, **overrides)
    torch.manual_seed(0)
    model = Eagle3Draft(cfg, embed_weight=embed)
    with torch.no_grad():  # non-trivial norms, so a swapped norm would change the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    counts = torch.randint(0, 50, (VOCAB,), generator=torch.Generator().manual_seed(1))
    vmap = build_vocab_map(counts, DRAFT_VOCAB)
    model.set_vocab(vmap.d2t, vmap.t2d)
    return model.eval()


@pytest.fixture()
def draft(target_config: dict, embed: torch.Tensor) -> Eagle3Draft:
    return make_draft(target_config, embed)


def two_steps(model: Eagle3Draft) -> list[torch.Tensor]:
    """Logits and hidden states of a first (3H aux) step and a second (H) step."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 5), generator=gen)
    aux = torch.randn(2, 5, 3 * H, generator=gen)
    cache = model.new_cache()
    with torch.no_grad():
        first = model.step(ids, aux, torch.arange(5).expand(2, 5), cache)
        nxt = first.logits[:, -1:].argmax(-1)
        second = model.step(nxt, first.hidden[:, -1:], torch.full((2, 1), 5), cache)
    return [first.logits, first.hidden, second.logits, second.hidden]


def assert_same_model(a: Eagle3Draft, b: Eagle3Draft) -> None:
    for x, y in zip(two_steps(a), two_steps(b), strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)
    assert a.config == b.config


def test_sglang_round_trip_gives_identical_logits(draft: Eagle3Draft, embed: torch.Tensor, tmp_path: Path) -> None:
    out = export_sglang(draft, tmp_path / "final", expected_aux_layer_ids=AUX)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_model(draft, load_exported(out, embed))


def specforge_shaped(out: Path) -> None:
    """Rewrite an SGLang export's config.json the way SpecForge 0.2.0's exporter writes one: its
    LlamaConfig through transformers' save_pretrained (which writes `dtype`, not `torch_dtype`,
    and rope as `rope_parameters`), no `target_hidden_size`, then its legacy-rope fix-up putting
    `rope_theta` back at the top level."""
    from transformers import LlamaConfig

    ours = json.loads((out / "config.json").read_text())
    kept = {k: v for k, v in ours.items() if k not in ("target_hidden_size", "torch_dtype", "eaglescale", "architectures")}
    LlamaConfig(**kept, dtype=ours["torch_dtype"], architectures=ours["architectures"]).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (out / "config.json").write_text(json.dumps(config))


def test_specforge_shaped_export_loads_as_sglang_reads_it(draft: Eagle3Draft, embed: torch.Tensor, tmp_path: Path) -> None:
    """Run 10 lost SpecForge's replay to a reader stricter than SGLang: a draft without
    target_hidden_size and with transformers 5's `dtype` serves on SGLang, so it loads here."""
    out = export_sglang(draft, tmp_path / "final", expected_aux_layer_ids=AUX)
    specforge_shaped(out)
    config = json.loads((out / "config.json").read_text())
    assert "target_hidden_size" not in config and "torch_dtype" not in config and config["dtype"] == "float32"
    assert_same_model(draft, load_exported(out, embed))


def test_specforge_shaped_export_still_checked_against_its_dtype(draft: Eagle3Draft, embed: torch.Tensor, tmp_path: Path) -> None:
    out = export_sglang(draft, tmp_path / "final")
    specforge_shaped(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    with pytest.raises(ExportError, match=r"fc.weight has dtype torch.float32, expected torch.bfloat16"):
        load_exported(out, embed)


def test_speculators_round_trip_gives_identical_logits(
    draft: Eagle3Draft, embed: torch.Tensor, tiny_target_dir: Path, tmp_path: Path
) -> None:
    out = export_speculators(draft, tmp_path / "spec", str(tiny_target_dir), verifier_architectures=["LlamaForCausalLM"])
    assert_same_model(draft, load_exported(out, embed))


def test_sglang_names_shapes_dtypes_match_design_table(draft: Eagle3Draft, tmp_path: Path) -> None:
    out = export_sglang(draft, tmp_path / "final")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        found = {k: (list(f.get_tensor(k).shape), f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118
    assert found == SGLANG_TABLE
    d2t, t2d = load_file(str(out / "model.safetensors"))["d2t"], load_file(str(out / "model.safetensors"))["t2d"]
    assert torch.equal(t2d.nonzero().flatten(), torch.arange(DRAFT_VOCAB) + d2t)


def test_bf16_export_casts_floats_only(draft: Eagle3Draft, tmp_path: Path) -> None:
    out = export_sglang(draft, tmp_path / "bf16", dtype="bfloat16")
    weights = load_file(str(out / "model.safetensors"))
    assert {k: v.dtype for k, v in weights.items()} == {
        k: (torch.bfloat16 if dt == torch.float32 else dt) for k, (_, dt) in SGLANG_TABLE.items()
    }
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_sglang_config_json(draft: Eagle3Draft, tmp_path: Path) -> None:
    config = json.loads((export_sglang(draft, tmp_path / "f") / "config.json").read_text())
    assert {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": draft.config.max_position_embeddings,
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
        "target_hidden_size": H, "torch_dtype": "float32", "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True},
    }.items() <= config.items()
    assert set(config) - {"attention_bias", "mlp_bias", "initializer_range", "eaglescale"} == {
        "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
        "rope_scaling", "max_position_embeddings", "vocab_size", "draft_vocab_size",
        "tie_word_embeddings", "target_hidden_size", "torch_dtype", "hidden_act", "eagle_config",
    }


def test_speculators_config_and_weight_names(draft: Eagle3Draft, tiny_target_dir: Path, tmp_path: Path) -> None:
    out = export_speculators(draft, tmp_path / "spec", "org/tiny-target", verifier_architectures=["LlamaForCausalLM"], speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]},
    }
    # vLLM's convention: id k = the stream entering layer k = output of layer k - 1.
    assert config["eagle_aux_hidden_state_layer_ids"] == [a + 1 for a in AUX]
    assert config["norm_before_residual"] is False
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (DRAFT_VOCAB, H)
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"], layer["hidden_size"]) == ("llama", 1, VOCAB, H)
    names = set(load_file(str(out / "model.safetensors")))
    expected = {k.replace("midlayer.", "layers.0.") for k in SGLANG_TABLE}
    assert names == expected and not any(n.startswith("midlayer.") for n in names)


def test_speculators_verifier_resolves_from_anywhere(draft: Eagle3Draft, tiny_target_dir: Path, tmp_path: Path, monkeypatch) -> None:
    # A relative folder (what a run's target.model_path used to be) is recorded absolute, with
    # the folder's own architectures; a hub id is kept; a missing path is refused.
    monkeypatch.chdir(tiny_target_dir.parent)
    out = export_speculators(draft, tmp_path / "spec", tiny_target_dir.name)
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(tiny_target_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    out = export_speculators(draft, tmp_path / "hub", "org/tiny-target")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "org/tiny-target", "architectures": []}
    with pytest.raises(ExportError, match=rf"verifier '\./nope' is a path, but {tiny_target_dir.parent}/nope does not exist"):
        export_speculators(draft, tmp_path / "bad", "./nope")


def _speculators_logits(model: torch.nn.Module, input_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """speculators' Eagle3 forward (its training-time-test unroll) returns argmax tokens only;
    its lm_head's outputs are the logits of each step."""
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    try:
        with torch.no_grad():
            model(
                hidden_states=aux, input_ids=input_ids, document_ids=torch.zeros_like(input_ids),
                position_ids=torch.arange(input_ids.shape[1]).unsqueeze(0), ttt_steps=steps,
            )  # fmt: skip
    finally:
        hook.remove()
    return logits


def test_speculators_library_loads_the_export_from_another_directory(
    draft: Eagle3Draft, embed: torch.Tensor, tiny_target_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The real speculators package (pinned in the dev extra) loads train/final-speculators
    from a directory other than the one it was exported in, and computes eaglescale's logits."""
    from importlib.metadata import version

    from speculators import SpeculatorModel

    from tasks.draft.export_checks import SPECULATORS_VERSION
    from tasks.draft.ttt import shift_left, unroll

    assert version("speculators") == SPECULATORS_VERSION  # the schema written is the one tested
    monkeypatch.chdir(tiny_target_dir.parent)
    out = export_speculators(draft, tmp_path / "export/final-speculators", tiny_target_dir.name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # from_pretrained opens the verifier (its config for the layer ids, its weights) by the
    # recorded name_or_path, from this directory.
    model = SpeculatorModel.from_pretrained(str(out)).eval()
    assert type(model).__name__ == "Eagle3DraftModel"
    assert model.config.eagle_aux_hidden_state_layer_ids == [a + 1 for a in AUX]
    # The export carries no embedding (vLLM shares the verifier's). speculators fills a missing
    # one from the verifier only when it is NaN, which its transformers leaves uninitialized
    # instead, so its own verifier loader is asked to overwrite it, again by the recorded path.
    model._load_verifier_weights(overwrite_embed_tokens=True)
    assert torch.equal(model.embed_tokens.weight, embed)
    assert torch.equal(model.d2t, draft.d2t) and torch.equal(model.t2d, draft.t2d)

    gen = torch.Generator().manual_seed(3)
    # 128 positions: one flex-attention block (speculators 0.9.0's mask extension for the
    # later steps assumes whole blocks).
    t, steps = 128, 3
    ids = torch.randint(0, VOCAB, (1, t), generator=gen)
    aux = torch.randn(1, t, 3 * H, generator=gen)
    theirs = _speculators_logits(model, shift_left(ids, 1), aux, steps)
    with torch.no_grad():
        ours = [draft.logits(hidden) for hidden in unroll(draft, ids, aux, steps)]
    assert len(theirs) == len(ours) == steps
    assert torch.equal(theirs[0], ours[0])
    for k in range(1, steps):  # attention over two steps' keys: summed in another order
        torch.testing.assert_close(theirs[k], ours[k], rtol=1e-5, atol=1e-5)
        assert torch.equal(theirs[k].argmax(-1), ours[k].argmax(-1))


def test_wrong_fc_width_refused_and_nothing_written(draft: Eagle3Draft, tmp_path: Path) -> None:
    draft.fc = nn.Linear(2 * H, H, bias=False)  # a draft fed two aux layers, not three
    with pytest.raises(ExportError, match=r"fc\.weight has shape \(64, 128\), expected \(64, 192\).*fc in-features"):
        export_sglang(draft, tmp_path / "final")
    with pytest.raises(ExportError, match=r"fc\.weight"):
        export_speculators(draft, tmp_path / "spec", "org/tiny")
    assert list(tmp_path.iterdir()) == []


def test_wrong_layer_ids_refused(target_config: dict, embed: torch.Tensor, tmp_path: Path) -> None:
    model = make_draft(target_config, embed, aux_layer_ids=[2, 3, 4])
    with pytest.raises(ExportError, match=r"eagle_aux_hidden_state_layer_ids \[2, 3, 4\] differ from \[1, 3, 4\]"):
        export_sglang(model, tmp_path / "final", expected_aux_layer_ids=AUX)
    model = make_draft(target_config, embed, aux_layer_ids=[1, 4, 3])
    with pytest.raises(ExportError, match=r"distinct, ascending"):
        export_sglang(model, tmp_path / "final")
    model = make_draft(target_config, embed, aux_layer_ids=[1, 3, 8])
    with pytest.raises(ExportError, match=r"reach past the target's 8 layers"):
        export_sglang(model, tmp_path / "final")
    assert list(tmp_path.iterdir()) == []


def test_inconsistent_vocab_map_refused(draft: Eagle3Draft, tmp_path: Path) -> None:
    draft.d2t[3] += 1
    with pytest.raises(ExportError, match=r"d2t and t2d disagree at draft id 3"):
        export_sglang(draft, tmp_path / "final")


def test_load_refuses_unknown_and_missing_tensors(draft: Eagle3Draft, embed: torch.Tensor, tmp_path: Path) -> None:
    out = export_sglang(draft, tmp_path / "final")
    weights = load_file(str(out / "model.safetensors"))
    weights["midlayer.self_attn.qkv_proj.weight"] = weights.pop("midlayer.self_attn.q_proj.weight")
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(ExportError) as err:
        load_exported(out, embed)
    assert "required tensor midlayer.self_attn.q_proj.weight is missing" in str(err.value)
    assert "unknown tensor midlayer.self_attn.qkv_proj.weight" in str(err.value)


def test_load_refuses_speculators_without_norm_before_residual(draft: Eagle3Draft, embed: torch.Tensor, tmp_path: Path) -> None:
    out = export_speculators(draft, tmp_path / "spec", "org/tiny")
    config = json.loads((out / "config.json").read_text())
    del config["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"norm_before_residual must be false"):
        load_exported(out, embed)


def test_reexport_replaces_folder_atomically(draft: Eagle3Draft, embed: torch.Tensor, tmp_path: Path) -> None:
    export_speculators(draft, tmp_path / "final", "org/tiny")
    (tmp_path / "final" / "stale.txt").write_text("old")
    out = export_sglang(draft, tmp_path / "final")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temp or old folders left
    assert "eagle_config" in json.loads((out / "config.json").read_text())


def commit_extract_shard(run: RunFolder, aux_layer_ids: list[int]) -> None:
    """One real extract shard (H6's writer and the commit protocol), two sequences."""
    from tasks.extract.local_capture import CapturedStates
    from tasks.extract.sequences import TrainingSequence
    from tasks.extract.storage import ShardWriter

    writer = ShardWriter(H, aux_layer_ids, "bf16")
    for i, split in enumerate(("train", "eval")):
        seq = TrainingSequence(f"req{i}", f"p{i}", "chat", split, [5, 6, 7, 8], [0, 0, 1, 1], False)
        writer.add(seq, CapturedStates(aux=torch.randn(4, 3 * H), last=torch.randn(4, H)))
    dead = pa.Table.from_pylist([], schema=pa.schema([("request_id", pa.string())]))
    extra = {"aux_layer_ids": aux_layer_ids, "hidden_size": H, "storage_dtype": "bf16", "splits": {"train": 1, "eval": 1}}
    shard = ShardCommit("s000", "a1", "fp", ["req0", "req1"], dead, extra=extra)
    ShardStore(run, "extract").commit_payload(writer.to_bytes(), "safetensors", ["req0", "req1"], shard)


def test_export_to_run_checks_extraction_layer_ids(draft: Eagle3Draft, embed: torch.Tensor, tmp_path: Path) -> None:
    run = RunFolder(str(tmp_path / "run"))
    with pytest.raises(ExportError, match=r"cannot check aux layer ids against the extraction.*no committed shards"):
        export_to_run(draft, run)
    commit_extract_shard(run, [1, 3, 5])
    with pytest.raises(ExportError, match=r"\[1, 3, 4\] differ from \[1, 3, 5\] \(the extraction in .*extract\)"):
        export_to_run(draft, run)
    assert not run.exists("train/final/config.json")

    good = RunFolder(str(tmp_path / "good"))
    commit_extract_shard(good, AUX)
    url = export_to_run(draft, good)
    assert url == f"{good.url}/train/final"
    assert_same_model(draft, load_exported(good.path("train/final"), embed))


def _checkpoint(model: Eagle3Draft, root: Path) -> Path:
    """A real step-N folder written by the trainer's checkpoint code."""
    from tasks.draft.checkpoint import save_checkpoint

    run = RunFolder(str(root))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Path(run.path(save_checkpoint(run, 10, model, optimizer, scheduler, {"step": 10})))


def test_cli_exports_a_checkpoint_folder(draft: Eagle3Draft, embed: torch.Tensor, tiny_target_dir: Path, tmp_path: Path, capsys) -> None:
    ckpt = _checkpoint(draft, tmp_path / "run")
    assert export_main([str(ckpt), str(tmp_path / "sg"), "--format", "sglang", "--expect-aux-layers", "1,3,4"]) == 0
    assert_same_model(draft, load_exported(tmp_path / "sg", embed))
    rc = export_main([str(ckpt), str(tmp_path / "spec"), "--format", "speculators", "--verifier", str(tiny_target_dir)])
    assert rc == 0
    verifier = json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(tiny_target_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert_same_model(draft, load_exported(tmp_path / "spec", embed))
    assert "exported speculators draft" in capsys.readouterr().out


def test_cli_refuses_incomplete_checkpoint_and_wrong_layers(draft: Eagle3Draft, tmp_path: Path, capsys) -> None:
    ckpt = _checkpoint(draft, tmp_path / "run")
    assert export_main([str(ckpt), str(tmp_path / "out"), "--expect-aux-layers", "1,29,57"]) == 1
    assert "differ from [1, 29, 57]" in capsys.readouterr().err
    (ckpt / "meta.json").unlink()
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 1
    assert "incomplete (no meta.json" in capsys.readouterr().err
    assert export_main([str(ckpt), str(tmp_path / "out"), "--format", "speculators"]) == 2
    assert "needs --verifier" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
