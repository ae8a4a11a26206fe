"""A small Qwen3 GGUF written here, shaped like llama.cpp's export of a Qwen3 dense model: the
`qwen3` architecture, no attention biases, an RMS norm per head on queries and keys
(`attn_q_norm`, `attn_k_norm`, [head_dim] each), a head dim of its own (128, twice
hidden / heads, as Qwen3-0.6B's 128 against 1024 / 16), an output tensor beside the token
embedding, K-quant and other tensor types, and the "qwen2" pre-tokenizer that Qwen3's files name,
with tests/qwen2_support.py's vocabulary, control tokens and ChatML template.

A head dim of 128 also keeps transformers' own GGUF loader comparable: it reads no head dim
for `qwen3` (its config mapping has no attention.key_length) and falls back to Qwen3Config's 128.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.qwen2_support import CHAT_TEMPLATE, CONTROL, USER_DEFINED, _k_quant, train_vocab

HEAD_DIM = 128


def _vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): Qwen2's BPE, its control and user-defined tokens, padding."""
    tokens, merges = train_vocab(vocab_size - len(CONTROL) - len(USER_DEFINED))
    types = [1] * len(tokens)  # NORMAL
    for group, kind in ((CONTROL, 3), (USER_DEFINED, 4)):
        tokens += group
        types += [kind] * len(group)
    while len(tokens) % 64:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    return tokens, types, merges


def _metadata(w: Any, *, layers: int, hidden: int, heads: int, kv_heads: int,
              intermediate: int, context_length: int) -> None:  # fmt: skip
    w.add_name("tiny qwen3 (eaglescale tests)")
    w.add_block_count(layers)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)


def _tokenizer(w: Any, tokens: list[str], types: list[int], merges: list[str]) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_tiny_qwen3_gguf(
    path: Path,
    *,
    seed: int = 0,
    layers: int = 8,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    vocab_size: int = 1024,
    context_length: int = 4096,
) -> Path:
    """Write the GGUF to `path` (deterministic for a seed) and return it. 8 layers give EAGLE-3
    three distinct aux layers ([1, 3, 4])."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    tokens, types, merges = _vocab(vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    _metadata(writer, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
              intermediate=intermediate, context_length=context_length)  # fmt: skip
    _tokenizer(writer, tokens, types, merges)

    def matrix(name: str, rows: int, cols: int, kind: str, std: float | None = None) -> None:
        std = std if std is not None else 1.0 / np.sqrt(cols)
        if kind in ("Q4_K", "Q6_K"):
            writer.add_tensor(name, _k_quant(rng, rows, cols, kind, std), raw_dtype=Q[kind])
            return
        w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        writer.add_tensor(name, w.astype(np.float16) if kind == "F16" else quantize(w, Q[kind]),
                          raw_dtype=None if kind == "F16" else Q[kind])  # fmt: skip

    def vector(name: str, size: int, center: float, std: float) -> None:
        writer.add_tensor(name, (center + rng.standard_normal(size) * std).astype(np.float32))

    q_rows, kv_rows = heads * HEAD_DIM, kv_heads * HEAD_DIM
    matrix("token_embd.weight", len(tokens), hidden, "Q4_K", std=1.0)
    for i in range(layers):
        last, p = i == layers - 1, f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0, 0.1)
        matrix(p + "attn_q.weight", q_rows, hidden, "Q4_K")
        vector(p + "attn_q_norm.weight", HEAD_DIM, 1.0, 0.2)  # non-trivial: a skipped norm shows
        matrix(p + "attn_k.weight", kv_rows, hidden, "Q4_K")
        vector(p + "attn_k_norm.weight", HEAD_DIM, 1.0, 0.2)
        matrix(p + "attn_v.weight", kv_rows, hidden, "Q6_K" if i % 2 else "Q4_K")
        matrix(p + "attn_output.weight", hidden, q_rows, "F16" if last else "Q4_K")
        vector(p + "ffn_norm.weight", hidden, 1.0, 0.1)
        matrix(p + "ffn_gate.weight", intermediate, hidden, "Q8_0" if last else "Q4_K")
        matrix(p + "ffn_up.weight", intermediate, hidden, "Q5_0" if last else "Q4_K")
        matrix(p + "ffn_down.weight", hidden, intermediate, "Q6_K")
    vector("output_norm.weight", hidden, 1.0, 0.1)
    matrix("output.weight", len(tokens), hidden, "Q6_K", std=3.0 / np.sqrt(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
