"""A Qwen3 target (per-head q/k RMS norms, no attention biases, a head dim of its own): the small
GGUF of tests/qwen3_support.py converted into a folder that equals what transformers' own GGUF
loader makes of it, then the whole way through on it: extraction, offline and online training,
both exports (SGLang's EAGLE3, vLLM's speculators), and the gate's local engine, whose static
forward equals transformers' and whose speculative decoding equals greedy decoding.

What eaglescale knows about Qwen3 is tasks/target/families/qwen3.py and its name in the
registry's list; nothing else was changed to add it (tests/test_target_families.py checks that
the consumers hold no family names)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.target.gguf_convert import convert_gguf, converted_dir
from tasks.target.tokenizer import load_tokenizer, render_prompt_ids
from tests.qwen2_support import CHAT_TEMPLATE
from tests.qwen3_support import HEAD_DIM, write_tiny_qwen3_gguf

PROMPT = [{"role": "user", "content": "Write a Python function is_prime(n)."}]
AUX = [1, 3, 4]  # [1, L//2 - 1, L - 4] of 8 layers, Llama's convention


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Small ops on 2 shared cores: OpenMP spin-waits make 2 threads many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_gguf(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf")


@pytest.fixture(scope="module")
def ours(gguf: Path) -> Path:
    return converted_dir(gguf, str(gguf))  # the session's $EAGLESCALE_CACHE, as a run resolves it


def _model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()


def test_conversion_is_deterministic_with_qwen3s_config(gguf: Path, ours: Path, tmp_path: Path) -> None:
    again = convert_gguf(gguf, tmp_path / "again", source=str(gguf))
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        if name != "eaglescale_source.json":  # it records the source as given
            assert hashlib.sha256((ours / name).read_bytes()).digest() == hashlib.sha256((again / name).read_bytes()).digest(), name
    config = json.loads((ours / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["head_dim"] == HEAD_DIM != config["hidden_size"] // config["num_attention_heads"]
    assert config["attention_bias"] is False and config["use_sliding_window"] is False
    assert config["tie_word_embeddings"] is False
    from safetensors import safe_open

    with safe_open(str(ours / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert list(f.get_tensor("model.layers.0.self_attn.q_norm.weight").shape) == [HEAD_DIM]
    assert {"model.layers.7.self_attn.q_norm.weight", "model.layers.7.self_attn.k_norm.weight"} <= keys
    assert not any(k.endswith(".bias") for k in keys)
    tok = load_tokenizer(str(ours))
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"
    # Qwen3's files name Qwen2's pre-tokenizer: NFC included.
    assert tok("cafe\u0301", add_special_tokens=False)["input_ids"] == tok("caf\u00e9", add_special_tokens=False)["input_ids"]


def test_equal_to_transformers_gguf_loader(gguf: Path, ours: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers asks for accelerate before any GGUF load; on the CPU its loader needs none.
    monkeypatch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    mine = _model(ours)
    assert type(theirs) is type(mine) and type(mine).__name__ == "Qwen3ForCausalLM"
    a, b = theirs.state_dict(), mine.state_dict()
    assert sorted(a) == sorted(b) and "model.layers.7.self_attn.k_norm.weight" in b
    for name in a:  # ours is bf16: theirs rounded to bf16 is ours exactly
        torch.testing.assert_close(a[name].to(torch.bfloat16).float(), b[name], rtol=0, atol=0, msg=name)
    tok_theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok_ours = load_tokenizer(str(ours))
    for text in ["Hello world 12345, what's up?", "def f(x):\n    return x**2", "<|im_start|>user\nHi<|im_end|>\n"]:
        assert tok_ours(text, add_special_tokens=False)["input_ids"] == tok_theirs(text, add_special_tokens=False)["input_ids"], text
    with torch.no_grad():
        for p in theirs.parameters():  # the same weights as ours: the forward is compared alone
            p.copy_(p.to(torch.bfloat16).float())
        ids = torch.tensor([render_prompt_ids(tok_ours, PROMPT)])
        out_theirs = theirs.generate(ids, max_new_tokens=16, do_sample=False)
        out_mine = mine.generate(ids, max_new_tokens=16, do_sample=False)
    assert out_mine[0, ids.shape[1] :].tolist() == out_theirs[0, ids.shape[1] :].tolist()


def test_the_gates_static_forward_and_extractions_capture_on_qwen3(ours: Path) -> None:
    """The gate's local engine runs the target layer by layer; Qwen3's family module gives it
    the per-head norms. Pieces of a sequence through the static cache = one transformers forward."""
    from tasks.draft.architecture import DraftConfig
    from tasks.extract.local_capture import LocalCapture
    from tasks.gate.spec_engine_graphs import StaticTarget

    model = _model(ours)
    assert DraftConfig.from_target(json.loads((ours / "config.json").read_text()), 512).aux_layer_ids == AUX
    ids = render_prompt_ids(load_tokenizer(str(ours)), PROMPT)[:40]
    static = StaticTarget(model, AUX, max_len=128)
    with torch.inference_mode():
        pieces = [static.forward(torch.tensor(ids[lo:hi]), torch.arange(lo, hi))
                  for lo, hi in [(0, 30), (30, 33), *[(i, i + 1) for i in range(33, len(ids))]]]  # fmt: skip
        ref = model(torch.tensor([ids])).logits[0]
        full = LocalCapture(model, AUX).capture([ids])[0]
    torch.testing.assert_close(torch.cat([p[0] for p in pieces]), ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([p[1] for p in pieces]), full.aux, atol=2e-4, rtol=1e-4)
    # Without the family's norms the static forward would be another model: the norms matter here.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
        assert not torch.allclose(model(torch.tensor([ids])).logits[0], ref, atol=1e-2)


# -- the pipeline on it ------------------------------------------------------------------------

TRAIN = {"draft_vocab_size": 256, "ttt_steps": 2, "learning_rate": 3e-3, "warmup_steps": 1, "batch_tokens": 1024,
         "max_steps": 4, "eval_every": 4, "save_every": 4, "intermediate_size": 128, "scaling_fractions": []}  # fmt: skip


def _config(dest: Path, gguf: Path, hidden_states: str) -> Any:
    from tasks.config import load_config
    from tests.run_support import write_params

    dest.mkdir(parents=True, exist_ok=True)
    params = write_params(
        dest, gguf, str(dest / "run"),
        sampling={"max_new_tokens": 8},
        engine={"kind": "local", "batch_size": 12},
        generate={"shard_size": 12, "max_parallel_shards": 1},
        discover={"total_prompts": 24, "holdout_per_domain": 2},
        extract={"batch_size": 4, "max_length": 512, "eval_fraction": 0.25},
        train={**TRAIN, "hidden_states": hidden_states},
    )  # fmt: skip
    return load_config(params)


def _check_exports(run: Any, model_path: str) -> None:
    from speculators import SpeculatorModel

    from tasks.target.model_dir import resolve_model_dir

    final = json.loads(run.read_bytes("train/final/config.json"))
    assert final["architectures"] == ["LlamaForCausalLMEagle3"] and final["target_hidden_size"] == 256
    assert final["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert final["eaglescale"]["target_model_type"] == "qwen3"
    verifier = json.loads(run.read_bytes("train/final-speculators/config.json"))["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(resolve_model_dir(model_path).resolve()), "architectures": ["Qwen3ForCausalLM"]}
    draft = SpeculatorModel.from_pretrained(run.path("train/final-speculators")).eval()
    draft._load_verifier_weights(overwrite_embed_tokens=True)  # opens the Qwen3 folder
    assert draft.config.eagle_aux_hidden_state_layer_ids == [a + 1 for a in AUX]


def test_extraction_training_both_exports_and_the_local_gate_on_qwen3(gguf: Path, tmp_path: Path) -> None:
    from tasks.extract.stage import ExtractStage
    from tasks.extract.storage import extract_metadata
    from tasks.gate.spec_engine import SpecEngine
    from tasks.runfolder import RunFolder
    from tasks.train.stage import run_train_stage
    from tests.run_support import generate_all

    cfg = _config(tmp_path / "offline", gguf, "offline")
    generate_all(cfg, batch_size=12)
    run = RunFolder(cfg.run_root)
    stage = ExtractStage(cfg, run, load_tokenizer(cfg.target.model_path))
    for shard_id in stage.prepare():
        assert stage.run_shard(shard_id).status == "committed"
    assert stage.finish()["complete"]
    stage.close()
    assert extract_metadata(run)["aux_layer_ids"] == AUX and extract_metadata(run)["hidden_size"] == 256
    assert run_train_stage(cfg).summary["steps"] == TRAIN["max_steps"]
    _check_exports(run, cfg.target.model_path)

    # Online: the same generation, nothing extracted; the trainer runs the Qwen3 target itself.
    shutil.copytree(tmp_path / "offline" / "run", tmp_path / "online" / "run")
    online_cfg = _config(tmp_path / "online", gguf, "online")
    online = RunFolder(online_cfg.run_root)
    online.remove("extract", recursive=True)
    online.remove("train", recursive=True)
    assert run_train_stage(online_cfg).summary["steps"] == TRAIN["max_steps"]
    assert not online.exists("extract")
    _check_exports(online, online_cfg.target.model_path)

    # The gate's local engine: the exported draft over the converted target, lossless.
    engine = SpecEngine.from_pretrained(cfg.target.model_path, run.path("train/final"))
    prompt = render_prompt_ids(load_tokenizer(cfg.target.model_path), PROMPT)
    greedy = engine.greedy(prompt, 12)
    with torch.no_grad():
        reference = engine.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert greedy.output_ids == reference.tolist()[: len(greedy.output_ids)] and len(greedy.output_ids) > 1
    for steps in (1, 3):
        spec = engine.speculate(prompt, 12, steps)
        assert spec.output_ids == greedy.output_ids and spec.verify_steps > 0
