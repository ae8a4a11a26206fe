"""DeepSeek-V2/V3 and Kimi-K2 (one model class in SGLang, DeepseekV2ForCausalLM), and Kimi-K2.5,
whose KimiK25ForConditionalGeneration wraps that language model under `text_config`.

Served by SGLang only here (the production profile, deployments/params/kimi-k25.yaml): no GGUF
conversion, and the local engine's static forward has no MLA attention.

SGLang (read from its source, not run here): DeepseekV2ForCausalLM's
`set_eagle3_layers_to_capture` is Llama's (ids + 1, the residual entering the layer; default
[2, L//2, L - 3]); KimiK25ForConditionalGeneration passes it to its language model.
"""

from __future__ import annotations

from tasks.target.families.base import TargetFamily

DEEPSEEK = TargetFamily(
    model_type="deepseek_v3",
    aliases=("deepseek_v2", "kimi_k2"),
    architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    sglang_capture="next_layer_input",
)
KIMI_K25 = TargetFamily(
    model_type="kimi_k25",
    architectures=("KimiK25ForConditionalGeneration",),
    sglang_capture="next_layer_input",
    text_config_key="text_config",
)
FAMILIES = (DEEPSEEK, KIMI_K25)
