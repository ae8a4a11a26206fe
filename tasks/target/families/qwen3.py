"""Qwen3 (Qwen3ForCausalLM): Qwen3's dense models.

The attention is Llama's without biases, plus an RMSNorm over each head's query and key
(`q_norm`, `k_norm`, weight [head_dim]) applied after the projection and before rope, and a
head_dim of its own (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024).

SGLang (python/sglang/srt/models/qwen3.py, read, not run here): `set_eagle3_layers_to_capture`
is Llama's (ids + 1; default [2, L//2, L - 3]), the capture being the residual stream handed to
the flagged layer: the output of layer i.

GGUF: llama.cpp's `qwen3` architecture (convert_hf_to_gguf.py's Qwen3Model, a Qwen2Model:
nothing permuted) stores the norms as `blk.<i>.attn_q_norm` / `attn_k_norm` and the head dim as
`qwen3.attention.key_length`; its files name the "qwen2" pre-tokenizer (tasks/target/families/qwen2.py).
"""

from __future__ import annotations

from typing import Any

from tasks.target.families.base import (
    LLAMA_LAYER_TENSORS,
    GGUFShape,
    GGUFSpec,
    StaticForward,
    TargetFamily,
    llama_qkv,
)


def _gguf_config(shape: GGUFShape) -> dict[str, Any]:
    # Full attention in every layer, as llama.cpp runs it (the GGUF has no window).
    return {"attention_bias": False, "head_dim": shape.head_dim, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": shape.layers}  # fmt: skip


def _qkv(attn: Any, x: Any, heads: int, kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
    """Llama's projections, then each head's RMS norm (over the last axis, head_dim, so
    normalizing [1, heads, S, D] is transformers' normalizing [1, S, heads, D])."""
    q, k, v = llama_qkv(attn, x, heads, kv_heads, head_dim)
    return attn.q_norm(q), attn.k_norm(k), v


QWEN3 = TargetFamily(
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM",),
    sglang_capture="next_layer_input",
    gguf=GGUFSpec(
        architecture="qwen3",
        config=_gguf_config,
        layer_tensors={**LLAMA_LAYER_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    ),
    static=StaticForward(project_qkv=_qkv, modules=("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
)
FAMILIES = (QWEN3,)
