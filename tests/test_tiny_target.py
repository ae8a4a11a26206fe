"""The tiny target build and the target helpers (tokenizer, chat template, identity)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from tasks.target.identity import target_identity
from tasks.target.model_dir import TargetError
from tasks.target.tiny import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    build_tiny_target,
    collect_sample_text,
    tiny_target_main,
)
from tasks.target.tokenizer import count_prompt_tokens, load_tokenizer, render_prompt_ids

TARGET_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Sort [3, 1, 2]."},
    {"role": "assistant", "content": "[1, 2, 3]"},
    {"role": "user", "content": "Now reversed?"},
]


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir: Path):
    return load_tokenizer(str(tiny_target_dir))


def test_build_is_byte_identical_for_a_seed(tiny_target_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_target(tmp_path / "again")
    other_seed = build_tiny_target(tmp_path / "seed1", seed=1)
    first, second, third = (file_hashes(p) for p in (tiny_target_dir, again, other_seed))
    assert set(first) == TARGET_FILES
    assert first == second
    # Another seed changes the weights only; the tokenizer is a function of the sample text.
    assert {k for k in first if first[k] != third[k]} == {"model.safetensors"}


def test_model_folder_contents(tiny_target_dir: Path, tokenizer) -> None:
    config = json.loads((tiny_target_dir / "config.json").read_text())
    tok_config = json.loads((tiny_target_dir / "tokenizer_config.json").read_text())
    gen_config = json.loads((tiny_target_dir / "generation_config.json").read_text())
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (8, 4, 2)
    assert config["vocab_size"] == len(tokenizer) <= 2048
    assert config["eos_token_id"] == gen_config["eos_token_id"] == tokenizer.eos_token_id == eos_id
    assert tokenizer.pad_token_id is not None and tokenizer.bos_token_id is not None
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, eos_id}) == 3
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    with safe_open(str(tiny_target_dir / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (config["vocab_size"], config["hidden_size"])
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "def f(x):\n    return x ** 2  # square\n",
        "naïve café — 東京 🚀",
        "   leading spaces and\ttabs\n\n",
    ],
)
def test_tokenizer_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_every_role(tokenizer) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|system|>\nYou are terse.<|end|>"
        "<|user|>\nSort [3, 1, 2].<|end|>"
        "<|assistant|>\n[1, 2, 3]<|end|>"
        "<|user|>\nNow reversed?<|end|><|assistant|>\n"
    )
    without = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert without == text.removesuffix("<|assistant|>\n")


def test_prompt_ids_are_plain_ints_ending_in_the_generation_prompt(tokenizer) -> None:
    ids = render_prompt_ids(tokenizer, CONVERSATION)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[-2]) == "<|assistant|>"
    assert tokenizer.decode(ids[-1]) == "\n"
    assert count_prompt_tokens(tokenizer)(CONVERSATION) == len(ids)


def test_prompt_plus_reply_and_eos_is_the_rendered_conversation(tokenizer) -> None:
    # eos terminates the assistant turn, so a generated reply (eos included) extends the
    # prompt into exactly the ids of the conversation with that reply appended.
    reply = "Reversed: [3, 2, 1]"
    prompt = render_prompt_ids(tokenizer, CONVERSATION)
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    whole = tokenizer.apply_chat_template(
        [*CONVERSATION, {"role": "assistant", "content": reply}], tokenize=False
    )
    assert (
        prompt + reply_ids + [tokenizer.eos_token_id]
        == tokenizer(whole, add_special_tokens=False)["input_ids"]
    )


def test_bad_messages_are_named(tokenizer) -> None:
    with pytest.raises(TargetError, match=r"messages\[1\]\.content must be a string, got int"):
        render_prompt_ids(
            tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]
        )
    with pytest.raises(TargetError, match="unsupported chat role narrator"):
        render_prompt_ids(tokenizer, [{"role": "narrator", "content": "once"}])
    with pytest.raises(TargetError, match="non-empty list"):
        render_prompt_ids(tokenizer, [])


def test_chat_template_override_and_missing_model(tiny_target_dir: Path, tmp_path: Path) -> None:
    template_file = tmp_path / "plain.jinja"
    template_file.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = load_tokenizer(str(tiny_target_dir), chat_template=str(template_file))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    with pytest.raises(TargetError, match="neither a Jinja template nor a readable file"):
        load_tokenizer(str(tiny_target_dir), chat_template=str(tmp_path / "absent.jinja"))
    missing = tmp_path / "no-such-model"
    with pytest.raises(TargetError, match=f"target model not found: {missing}"):
        load_tokenizer(str(missing))


def test_the_tokenizer_is_read_once_per_process_and_each_caller_gets_its_own(
    tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import shutil

    import transformers

    reads: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained.__func__  # the classmethod's function

    def counting(cls, path, *args, **kwargs):  # noqa: ANN001, ANN202 - transformers' signature
        reads.append(str(path))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(counting))
    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    first = load_tokenizer(str(model))
    second = load_tokenizer(str(model))
    assert len(reads) == 1  # the stage flows of one process read it once
    # ... and each has its own: an edit to one leaks into no other caller.
    assert second is not first
    first.chat_template = "{{ 'edited' }}"
    assert load_tokenizer(str(model)).chat_template == second.chat_template != "{{ 'edited' }}"
    template_file = tmp_path / "plain.jinja"
    template_file.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    load_tokenizer(str(model), chat_template=str(template_file))
    assert len(reads) == 2  # another template: another entry
    # A template rewritten in place is read again (mtime and size are in the key).
    template_file.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    reread = load_tokenizer(str(model), chat_template=str(template_file))
    assert reread.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    config = model / "tokenizer_config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_tokenizer(str(model))
    assert len(reads) == 4  # the folder's files changed: read again


def test_target_identity(tiny_target_dir: Path, tokenizer, tmp_path: Path) -> None:
    identity = target_identity(str(tiny_target_dir), None, tokenizer)
    # Content only: a local folder's path is no part of it (the next node has it elsewhere).
    assert set(identity) == {"revision", "tokenizer_hash", "chat_template_hash", "context_length"}
    assert identity["revision"].startswith("sha256:")
    assert (
        identity["tokenizer_hash"]
        == hashlib.sha256((tiny_target_dir / "tokenizer.json").read_bytes()).hexdigest()
    )
    assert identity["chat_template_hash"] == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    assert identity["context_length"] == 2048
    assert target_identity(str(tiny_target_dir), None, tokenizer) == identity
    moved = shutil.copytree(tiny_target_dir, tmp_path / "elsewhere" / "model")
    assert target_identity(str(moved), None, load_tokenizer(str(moved))) == identity
    # A named revision stands for the weights: then where they were read from counts too.
    named = target_identity(str(tiny_target_dir), "v7", tokenizer)
    assert named["revision"] == "v7" and named["model_path"] == str(tiny_target_dir)

    # Same shapes, other weights: the revision digest still tells them apart.
    other = build_tiny_target(tmp_path / "seed1", seed=1)
    other_identity = target_identity(str(other), None, load_tokenizer(str(other)))
    assert {k for k in identity if identity[k] != other_identity[k]} == {"revision"}

    overridden = load_tokenizer(str(tiny_target_dir), chat_template="{{ messages[0]['content'] }}")
    changed = target_identity(str(tiny_target_dir), None, overridden)
    assert {k for k in identity if identity[k] != changed[k]} == {"chat_template_hash"}


def test_missing_sample_text_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "samples"
    empty.mkdir()
    (empty / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(FileNotFoundError, match=f"no sample text found under {empty}"):
        collect_sample_text(empty)
    with pytest.raises(FileNotFoundError, match="no sample text found"):
        build_tiny_target(tmp_path / "model", sample_dir=empty)
    assert not (tmp_path / "model").exists()


def test_sample_text_is_every_string_value(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text(json.dumps([{"q": "third", "n": 4, "tags": ["fourth"]}]))
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "first"}]}) + "\nnot json\n"
    )
    (tmp_path / "ignored.txt").write_text("never read")
    assert collect_sample_text(tmp_path) == ["user", "first", "third", "fourth"]


def test_cli_refuses_to_overwrite_without_force(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli-model"
    assert tiny_target_main([str(out), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    assert set(p.name for p in out.iterdir()) == TARGET_FILES
    assert tiny_target_main([str(out)]) == 2
    assert f"{out.resolve()} already exists" in capsys.readouterr().err
    before = file_hashes(out)["model.safetensors"]
    assert tiny_target_main([str(out), "--force"]) == 0
    assert file_hashes(out)["model.safetensors"] != before  # rebuilt with seed 0
    assert not list(tmp_path.glob(".cli-model.building-*"))
