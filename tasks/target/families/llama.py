"""Llama (LlamaForCausalLM): SmolLM2, the tiny target (tasks/target/tiny.py), Llama 2/3.

SGLang (read from its source, not run here): `LlamaForCausalLM.set_eagle3_layers_to_capture(ids)`
stores `layers_to_capture = [i + 1 for i in ids]` and the model appends `hidden_states +
residual` on ENTERING layer i + 1, i.e. the output of layer i. Newer versions moved that append
into the decoder layer (`prepare_attn_and_capture_last_layer_outputs`, layers flagged
`_is_layer_to_capture`), still capturing the residual entering the flagged layer: the same
tensor. Without ids its default is [2, L//2, L - 3].

GGUF: llama.cpp's exporter (convert_hf_to_gguf.py's LlamaModel) permutes the q/k rows of each
head for GGML's rope; the converter undoes it. SmolLM's GGUFs name their own pre-tokenizer.
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


def _gguf_config(shape: GGUFShape) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False, "head_dim": shape.head_dim}


LLAMA = TargetFamily(
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    sglang_capture="next_layer_input",
    gguf=GGUFSpec(
        architecture="llama",
        config=_gguf_config,
        permute_qk=True,
        # SmolLM's: every digit its own pre-token, then GPT-2's byte-level split.
        pre_tokenizers={"smollm": PreTokenizer(({"type": "Digits", "individual_digits": True},))},
    ),
    static=StaticForward(),
)
FAMILIES = (LLAMA,)
