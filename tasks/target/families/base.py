"""The per-family interface: what eaglescale knows about one target family (docs/TARGETS.md).

A family module (tasks/target/families/<name>.py) describes its family with these types and
exports them as `FAMILIES`; tasks/target/families/registry.py collects them by `model_type`.
They are plain data and functions over duck-typed modules and tensors: nothing here imports
torch or transformers, because the configuration's input check reaches model_dir.py, which asks
the registry, and loading a configuration must not load either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# How SGLang captures EAGLE-3's aux hidden states for a family, read from its model code (each
# family module says where). Either way a draft config's ids name layer OUTPUTS
# (tasks/extract/capture.py holds that convention and the defaults):
# - "next_layer_input": `set_eagle3_layers_to_capture(ids)` stores ids + 1 and keeps the residual
#   stream entering those layers, the output of layer i; without ids it picks [2, L//2, L - 3].
# - "after_layer": it keeps the output of layer i as it returns (no + 1), and has no default.
SGLangCapture = Literal["next_layer_input", "after_layer"]

# Tensor names of the embedding, head and final norm, most common first; multimodal checkpoints
# prefix their language model. A family whose checkpoints name them otherwise lists its own.
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "transformer.wte.weight",
)
HEAD_KEYS = (
    "lm_head.weight",
    "language_model.lm_head.weight",
    "model.language_model.lm_head.weight",
)
NORM_KEYS = (
    "model.norm.weight",
    "language_model.model.norm.weight",
    "model.language_model.norm.weight",
)


@dataclass(frozen=True)
class PreTokenizer:
    """An HF tokenizers pipeline before BPE: normalizer, pre-tokenizers, then the byte-level
    mapping (with GPT-2's own split when `byte_level_regex`). Keyed by llama.cpp's name for it
    (a GGUF's `tokenizer.ggml.pre`), which a GGUF of another family may name too."""

    pre: tuple[dict[str, Any], ...] = ()
    normalizer: dict[str, Any] | None = None
    byte_level_regex: bool = True


# llama.cpp's tensor names inside block i -> HF's inside `model.layers.<i>.`, for a Llama-shaped
# decoder layer (Llama, Qwen2, Qwen3 share them; a family adds its extra tensors to these).
LLAMA_LAYER_TENSORS: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFShape:
    """The attention shape a GGUF's metadata gives, for a family's config keys."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


@dataclass(frozen=True)
class GGUFSpec:
    """How tasks/target/gguf_convert.py turns this family's GGUF into its HF folder. The config
    keys every family shares (sizes, rope, norms eps, token ids, tied embeddings) are the
    converter's; `config` adds the family's own and raises ValueError for a shape the family's
    transformers class cannot express (the converter names the file)."""

    architecture: str  # the GGUF's general.architecture, llama.cpp's name for the family
    config: Callable[[GGUFShape], dict[str, Any]]
    layer_tensors: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER_TENSORS))
    biases: tuple[str, ...] = ()  # GGUF layer tensors that carry a .bias as well
    permute_qk: bool = False  # llama.cpp's exporter permuted q/k rows for GGML's rope
    pre_tokenizers: Mapping[str, PreTokenizer] = field(default_factory=dict)  # llama.cpp names it brings


def llama_qkv(attn: Any, x: Any, heads: int, kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
    """q, k, v [1, heads, S, D] of a Llama-style attention module for x [1, S, H]: its own
    projections (their biases included, Qwen2's), before rope."""
    s = x.shape[1]
    q = attn.q_proj(x).view(1, s, heads, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(1, s, kv_heads, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(1, s, kv_heads, head_dim).transpose(1, 2)
    return q, k, v


@dataclass(frozen=True)
class StaticForward:
    """How the gate's local engine (tasks/gate/spec_engine_graphs.py::StaticTarget) runs this
    family's attention with its static KV cache. The rest of the layer is the Llama decoder
    layer's as transformers builds it (input norm, rotate-half rope from the model's
    rotary_emb, residuals, post-attention norm, MLP), which StaticTarget runs itself."""

    project_qkv: Callable[[Any, Any, int, int, int], tuple[Any, Any, Any]] = llama_qkv
    modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention must have these


@dataclass(frozen=True)
class TargetFamily:
    """Everything eaglescale knows about one target family. Only `model_type` is required; a
    part left at None is refused, naming the family, by the code that needs it."""

    model_type: str  # config.json's model_type: the registry's key
    aliases: tuple[str, ...] = ()  # other model_types that are this family
    architectures: tuple[str, ...] = ()  # transformers' class names, for the docs and errors
    sglang_capture: SGLangCapture | None = None  # None: not read from SGLang, no default aux ids
    embed_keys: tuple[str, ...] = EMBED_KEYS
    head_keys: tuple[str, ...] = HEAD_KEYS
    norm_keys: tuple[str, ...] = NORM_KEYS
    norm_plus_one: bool = False  # its RMSNorm scales by 1 + weight (not the draft's norm)
    text_config_key: str | None = None  # a multimodal wrapper's language-model config
    # transformers 5 says a >100k tokenizer from a folder without transformers_version (a GGUF
    # conversion's) may carry Mistral's broken regex: false for every family here, so declined.
    tokenizer_kwargs: Mapping[str, Any] = field(default_factory=lambda: {"fix_mistral_regex": False})
    gguf: GGUFSpec | None = None  # None: its GGUF files are refused
    static: StaticForward | None = None  # None: the local engine's gate refuses it

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.model_type, *self.aliases)
