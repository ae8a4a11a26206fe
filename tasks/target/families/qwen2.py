"""Qwen2 (Qwen2ForCausalLM): Qwen2 and Qwen2.5 (Qwen2.5-Coder-1.5B-Instruct's profile).

SGLang: `Qwen2ForCausalLM.set_eagle3_layers_to_capture` is Llama's (ids + 1, the residual
entering the layer; default [2, L//2, L - 3]).

The attention is Llama's with biases on q, k and v, which live in the projections' own Linear
layers: the local engine's static forward is Llama's. A Qwen2 config has no head_dim setting.

GGUF: convert_hf_to_gguf.py's Qwen2Model permutes nothing (its LlamaModel alone does); the
files name llama.cpp's "qwen2" pre-tokenizer, which Qwen3's files name too.
"""

from __future__ import annotations

from typing import Any

from tasks.target.families.base import (
    GGUFShape,
    GGUFSpec,
    PreTokenizer,
    StaticForward,
    TargetFamily,
)

# Qwen2's split (transformers' Qwen2Tokenizer and the model's own tokenizer.json; llama.cpp's
# "qwen2" pre-tokenizer spells the contractions case by case, the same pattern).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# NFC (its tokenizer.json normalizes; llama.cpp does not, so text that is not NFC may tokenize
# differently there), its split, then bytes without GPT-2's split.
QWEN2_PRE_TOKENIZER = PreTokenizer(
    ({"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},),
    normalizer={"type": "NFC"},
    byte_level_regex=False,
)


def _gguf_config(shape: GGUFShape) -> dict[str, Any]:
    if shape.head_dim != shape.hidden // shape.heads:
        raise ValueError(
            f"head dim {shape.head_dim} != hidden {shape.hidden} / heads {shape.heads}, "
            "which Qwen2ForCausalLM cannot express"
        )
    # Full attention in every layer, as llama.cpp runs it (the GGUF has no window).
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": shape.layers}


QWEN2 = TargetFamily(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM",),
    sglang_capture="next_layer_input",
    gguf=GGUFSpec(
        architecture="qwen2",
        config=_gguf_config,
        biases=("attn_q", "attn_k", "attn_v"),
        pre_tokenizers={"qwen2": QWEN2_PRE_TOKENIZER},
    ),
    static=StaticForward(),
)
FAMILIES = (QWEN2,)
