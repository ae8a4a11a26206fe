"""A tiny random-weight Llama target, built locally and deterministically.

The embedded default needs a real target model without hub access: this builds one from the
shipped sample prompts (a byte-level BPE tokenizer trained on their text, a chat template with
special role tokens, an 8-layer Llama with seeded random weights) and saves it as a normal HF
model folder that transformers loads with `local_files_only=True`.

Eight layers, so that EAGLE-3's aux layers [1, L//2-1, L-4] = [1, 3, 4] are distinct.
Same seed and same sample text give byte-identical files, so a rebuilt target has the same
fingerprint and resumes old runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import tasks

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS.values()]

# Llama-3-like: the turn terminator is the eos token and nothing follows it, so a prompt
# rendered with the generation prompt plus a generated reply (eos included) is token for token
# the rendering of the conversation with that reply appended.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported chat role ' ~ message['role'] ~ ' (expected system, user, "
    "assistant or tool)') }}"
    "{% endif %}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# A random model's eos logit is as likely as any other token's, so it would almost never stop.
# Scaling the eos row of the output head widens the spread of its logit: eos becomes the
# argmax in a few percent of contexts, and both greedy and sampled replies end on their own.
EOS_HEAD_SCALE = 2.0
# Output-head scale that makes next-token distributions peaked (logit std ~3), so sampled
# text is not uniform noise over the vocabulary.
LOGIT_STD = 3.0


def sample_prompts_dir() -> Path:
    return Path(tasks.__file__).parent / "data" / "sample_prompts"


def _string_values(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _string_values(value)
    elif isinstance(node, list):
        for value in node:
            yield from _string_values(value)


def collect_sample_text(sample_dir: str | Path | None = None) -> list[str]:
    """Every string value in the *.jsonl / *.json files under `sample_dir`, in a fixed order.

    Lines or files that are not valid JSON are skipped: the shipped set deliberately contains
    malformed rows, and the tokenizer only needs the text of the good ones.
    """
    root = Path(sample_dir) if sample_dir is not None else sample_prompts_dir()
    files = (
        sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".json"))
        if root.is_dir()
        else []
    )
    texts: list[str] = []
    for path in files:
        raw = path.read_text(encoding="utf-8", errors="replace")
        docs = raw.splitlines() if path.suffix == ".jsonl" else [raw]
        for doc in docs:
            try:
                texts.extend(_string_values(json.loads(doc)))
            except json.JSONDecodeError:
                continue
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise FileNotFoundError(f"no sample text found under {root} (*.jsonl / *.json)")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # Every byte stays encodable, whatever the sample text lacks.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _llama_config(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    max_positions: int,
    token_ids: dict[str, int],
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_ids["bos"],
        "eos_token_id": token_ids["eos"],
        "pad_token_id": token_ids["pad"],
        "head_dim": hidden_size // 4,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": hidden_size * 4,
        "max_position_embeddings": max_positions,
        "mlp_bias": False,
        "num_attention_heads": 4,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        # Both spellings: transformers 5 reads rope_parameters, 4.x (SGLang's pin) rope_theta.
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights drawn in a fixed order, independent of transformers' own init code."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim, kv_heads = cfg["head_dim"], cfg["num_key_value_heads"]
    vocab = cfg["vocab_size"]

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def proj(out_f: int, in_f: int) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps the residual stream O(1) so every layer matters for the output.
        return normal((out_f, in_f), 1.0 / math.sqrt(in_f))

    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, hidden), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = proj(4 * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = proj(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = proj(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = proj(hidden, 4 * head_dim)
        weights[p + "mlp.gate_proj.weight"] = proj(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = proj(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = proj(hidden, inter)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    head = normal((vocab, hidden), LOGIT_STD / math.sqrt(hidden))
    head[cfg["eos_token_id"]] *= EOS_HEAD_SCALE
    weights["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in weights.items()}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_target(
    tmp: Path,
    tokenizer: Tokenizer,
    seed: int,
    hidden_size: int,
    num_layers: int,
    max_positions: int,
) -> None:
    token_ids = {
        "bos": tokenizer.token_to_id(BOS_TOKEN),
        "eos": tokenizer.token_to_id(EOS_TOKEN),
        "pad": tokenizer.token_to_id(PAD_TOKEN),
    }
    cfg = _llama_config(
        tokenizer.get_vocab_size(), hidden_size, num_layers, max_positions, token_ids
    )
    tokenizer.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "config.json", cfg)
    _write_json(
        tmp / "generation_config.json",
        {
            "bos_token_id": token_ids["bos"],
            "eos_token_id": token_ids["eos"],
            "pad_token_id": token_ids["pad"],
        },
    )
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    _write_json(
        tmp / "tokenizer_config.json",
        {
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": max_positions,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(tmp / "special_tokens_map.json", special)
    weights = tmp / "model.safetensors"
    # One metadata key only: safetensors writes the metadata map in hash order, so more keys
    # would make the bytes differ from build to build.
    save_file(_random_weights(cfg, seed), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)


def build_tiny_target(
    out_dir: str | Path,
    seed: int = 0,
    *,
    force: bool = False,
    sample_dir: str | Path | None = None,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    num_layers: int = 8,
    max_position_embeddings: int = 2048,
) -> Path:
    """Build the tiny target into `out_dir` and return its path.

    The folder appears complete or not at all (built next to it, then renamed). An existing
    `out_dir` is an error unless `force`, which replaces it.
    """
    out = Path(out_dir).resolve()
    if hidden_size % 4:
        raise ValueError(f"hidden_size must be a multiple of 4 (4 heads), got {hidden_size}")
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists (pass force to replace it)")
    texts = collect_sample_text(sample_dir)
    tokenizer = train_tokenizer(texts, vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_target(tmp, tokenizer, seed, hidden_size, num_layers, max_position_embeddings)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny_target_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="eaglescale tiny-target",
        description="Build the tiny random-weight Llama target from the shipped sample prompts.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="model folder to create")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    try:
        path = build_tiny_target(args.out_dir, seed=args.seed, force=args.force)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
