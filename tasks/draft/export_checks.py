"""Self-checks of an exported EAGLE-3 draft, run before anything is written and on load.

SGLang's LlamaForCausalLMEagle3.load_weights skips names it does not know and never
compares shapes with the config, and it applies `fc` only when the hidden-state width
differs from the embedding width. A wrong name, a wrong fc width or wrong aux layer ids
therefore load "fine" and serve a draft whose acceptance is ~1.0. Every rule here turns
one of those silent failures into a refusal that names the problem.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tasks.draft.vocab import vocab_consistency_problems

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# config.json keys SGLang (and the load-back) need; each must be present with a value.
REQUIRED_CONFIG_KEYS = (
    "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "vocab_size", "draft_vocab_size", "tie_word_embeddings",
    "target_hidden_size", "torch_dtype", "eagle_config",
)


class ExportError(ValueError):
    """An exported draft (or one about to be exported) that a server would load wrongly."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in FLOAT_DTYPES.items():
        if value == dtype:
            return name
    raise ExportError(f"unsupported weight dtype {dtype}; export float32, bfloat16 or float16")


def aux_layer_ids_of(config: Mapping[str, Any]) -> list[int]:
    eagle = config.get("eagle_config")
    if not isinstance(eagle, Mapping) or "eagle_aux_hidden_state_layer_ids" not in eagle:
        raise ExportError("config.json: eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    return list(eagle["eagle_aux_hidden_state_layer_ids"])


def sglang_weight_table(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype kind) of every tensor in SGLang's EAGLE-3 checkpoint (docs/DESIGN.md §7).

    dtype kind is "float" (the checkpoint's torch_dtype), "int64" or "bool".
    """
    h = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    q_out = int(config["num_attention_heads"]) * int(config["head_dim"])
    kv_out = int(config["num_key_value_heads"]) * int(config["head_dim"])
    fc_in = int(config["target_hidden_size"]) * len(aux_layer_ids_of(config))
    table: dict[str, tuple[tuple[int, ...], str]] = {
        "fc.weight": ((h, fc_in), "float"),
        "midlayer.self_attn.q_proj.weight": ((q_out, 2 * h), "float"),
        "midlayer.self_attn.k_proj.weight": ((kv_out, 2 * h), "float"),
        "midlayer.self_attn.v_proj.weight": ((kv_out, 2 * h), "float"),
        "midlayer.self_attn.o_proj.weight": ((h, q_out), "float"),
        "midlayer.mlp.gate_proj.weight": ((inter, h), "float"),
        "midlayer.mlp.up_proj.weight": ((inter, h), "float"),
        "midlayer.mlp.down_proj.weight": ((h, inter), "float"),
        "midlayer.hidden_norm.weight": ((h,), "float"),
        "midlayer.input_layernorm.weight": ((h,), "float"),
        "midlayer.post_attention_layernorm.weight": ((h,), "float"),
        "norm.weight": ((h,), "float"),
        "lm_head.weight": ((int(config["draft_vocab_size"]), h), "float"),
        "d2t": ((int(config["draft_vocab_size"]),), "int64"),
        "t2d": ((int(config["vocab_size"]),), "bool"),
    }
    return table


def check_sglang_config(config: Mapping[str, Any]) -> list[str]:
    problems = [f"config.json: {key} is missing" for key in REQUIRED_CONFIG_KEYS if config.get(key) is None]
    if problems:
        return problems
    if SGLANG_ARCHITECTURE not in config["architectures"]:
        problems.append(f"config.json: architectures {config['architectures']} lacks {SGLANG_ARCHITECTURE}")
    if config["model_type"] != "llama":
        problems.append(f"config.json: model_type must be 'llama', got {config['model_type']!r}")
    if config["num_hidden_layers"] != 1:
        problems.append(f"config.json: num_hidden_layers must be 1, got {config['num_hidden_layers']}")
    if config["tie_word_embeddings"] is not False:
        problems.append("config.json: tie_word_embeddings must be false (the draft has its own lm_head)")
    if config["torch_dtype"] not in FLOAT_DTYPES:
        problems.append(f"config.json: torch_dtype {config['torch_dtype']!r} is not one of {sorted(FLOAT_DTYPES)}")
    # The embedding is the target's, so the draft's width must be the target's: otherwise
    # SGLang's "fc only when widths differ" rule and the q/k/v 2H input both break.
    if config["hidden_size"] != config["target_hidden_size"]:
        problems.append(
            f"config.json: hidden_size {config['hidden_size']} differs from target_hidden_size "
            f"{config['target_hidden_size']}; the draft shares the target's embedding, so they must match"
        )
    if config["draft_vocab_size"] > config["vocab_size"]:
        problems.append(f"config.json: draft_vocab_size {config['draft_vocab_size']} exceeds vocab_size {config['vocab_size']}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        problems.append("config.json: num_attention_heads is not a multiple of num_key_value_heads")
    eagle = config["eagle_config"]
    if not isinstance(eagle, Mapping) or eagle.get("use_aux_hidden_state") is not True:
        problems.append("config.json: eagle_config.use_aux_hidden_state must be true")
    try:
        ids = aux_layer_ids_of(config)
    except ExportError as err:
        return [*problems, str(err)]
    problems += aux_layer_id_problems(ids, (config.get("eaglescale") or {}).get("target_num_layers"))
    return problems


def aux_layer_id_problems(ids: Sequence[Any], target_num_layers: int | None = None) -> list[str]:
    if len(ids) != 3 or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return [f"eagle_aux_hidden_state_layer_ids must be 3 integers, got {list(ids)}"]
    if list(ids) != sorted(set(ids)) or ids[0] < 0:
        return [f"eagle_aux_hidden_state_layer_ids must be distinct, ascending and >= 0, got {list(ids)}"]
    if target_num_layers is not None and ids[-1] >= target_num_layers:
        return [f"eagle_aux_hidden_state_layer_ids {list(ids)} reach past the target's {target_num_layers} layers"]
    return []


def check_expected_aux_layers(ids: Sequence[int], expected: Sequence[int] | None, source: str) -> list[str]:
    if expected is None or list(ids) == list(expected):
        return []
    return [
        f"eagle_aux_hidden_state_layer_ids {list(ids)} differ from {list(expected)} ({source}); "
        "the draft would be fed different hidden states at serving time than it was trained on"
    ]


def check_sglang_weights(weights: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> list[str]:
    table = sglang_weight_table(config)
    float_dtype = FLOAT_DTYPES.get(config["torch_dtype"])
    problems = [f"model.safetensors: required tensor {name} is missing" for name in table if name not in weights]
    problems += [f"model.safetensors: unknown tensor {name} (SGLang would silently skip it)" for name in sorted(set(weights) - set(table))]
    for name, (shape, kind) in table.items():
        tensor = weights.get(name)
        if tensor is None:
            continue
        if tuple(tensor.shape) != shape:
            what = _shape_hint(name, shape, config)
            problems.append(f"model.safetensors: {name} has shape {tuple(tensor.shape)}, expected {shape}{what}")
        want = {"float": float_dtype, "int64": torch.int64, "bool": torch.bool}[kind]
        if tensor.dtype != want:
            problems.append(f"model.safetensors: {name} has dtype {tensor.dtype}, expected {want}")
    if not problems:
        problems += [f"model.safetensors: {p}" for p in vocab_consistency_problems(weights["d2t"], weights["t2d"])]
    return problems


def _shape_hint(name: str, shape: tuple[int, ...], config: Mapping[str, Any]) -> str:
    if name == "fc.weight":
        n_aux = len(aux_layer_ids_of(config))
        return (
            f" (fc in-features must be target_hidden_size {config['target_hidden_size']} x "
            f"{n_aux} aux layers = {shape[1]})"
        )
    return ""


def as_sglang_reads(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """A draft's config.json with the two fields SGLang can do without filled in as SGLang fills
    them, for checking and loading a draft another trainer wrote. `target_hidden_size`: SGLang's
    LlamaForCausalLMEagle3 falls back to `hidden_size`. `torch_dtype`: transformers >= 5's
    save_pretrained writes it as `dtype` (SpecForge 0.2.0's exporter saves through it, so its
    drafts carry `dtype` only); with neither, the weights' own float dtype. Our exporter writes
    both, so this changes nothing of ours."""
    out = dict(config)
    if out.get("target_hidden_size") is None and out.get("hidden_size") is not None:
        out["target_hidden_size"] = out["hidden_size"]
    if out.get("torch_dtype") is None:
        floats = [t.dtype for t in weights.values() if t.is_floating_point()]
        out["torch_dtype"] = out.get("dtype") or (dtype_name(floats[0]) if floats else None)
    return out


def check_sglang_export(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    expected_aux_layer_ids: Sequence[int] | None = None,
    expected_source: str = "expected",
    where: str = "export",
) -> None:
    """Raise ExportError listing every problem of an SGLang-format (config, weights) pair."""
    problems = check_sglang_config(config)
    if not problems:
        problems += check_expected_aux_layers(aux_layer_ids_of(config), expected_aux_layer_ids, expected_source)
        problems += check_sglang_weights(weights, config)
    if problems:
        raise ExportError(f"{where}: refusing the EAGLE-3 draft:\n  - " + "\n  - ".join(problems))


# ---- vLLM speculators format: the same tensors under other names, another config layout ----

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# The speculators release whose Eagle3SpeculatorConfig schema this writes: the one pinned in
# pyproject.toml's dev extra, which tests/test_export.py loads the export with.
SPECULATORS_VERSION = "0.9.0"
# Features of speculators' Eagle3 that this draft does not have; a checkpoint using one
# would load into Eagle3Draft with different maths, so it is refused.
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
_LAYER_PREFIX, _SPECULATORS_LAYER_PREFIX = "midlayer.", "layers.0."


def to_speculators_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        (_SPECULATORS_LAYER_PREFIX + k[len(_LAYER_PREFIX):] if k.startswith(_LAYER_PREFIX) else k): v
        for k, v in weights.items()
    }


def from_speculators_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        (_LAYER_PREFIX + k[len(_SPECULATORS_LAYER_PREFIX):] if k.startswith(_SPECULATORS_LAYER_PREFIX) else k): v
        for k, v in weights.items()
    }


_LAYER_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
    "initializer_range", "attention_bias", "mlp_bias", "vocab_size", "tie_word_embeddings",
)


def speculators_config(
    sglang: Mapping[str, Any],
    verifier_name: str,
    verifier_architectures: Sequence[str] | None = None,
    speculative_tokens: int = 3,
) -> dict[str, Any]:
    """speculators' Eagle3SpeculatorConfig (as its save_pretrained writes it) for a checked
    SGLang-style config."""
    if not verifier_name:
        raise ExportError("speculators export needs the verifier's name or path (--verifier)")
    if speculative_tokens < 1:
        raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    layer = {"model_type": "llama", "num_hidden_layers": 1, **{k: sglang.get(k) for k in _LAYER_KEYS}}
    layer["torch_dtype"] = sglang["torch_dtype"]
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": sglang["draft_vocab_size"],
        "target_hidden_size": sglang["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux_layer_ids_of(sglang)],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": sglang["torch_dtype"],
        "eaglescale": dict(sglang.get("eaglescale") or {}),
    }


def speculators_config_problems(config: Mapping[str, Any]) -> list[str]:
    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type must be 'eagle3', got {config.get('speculators_model_type')!r}")
    spec = config.get("speculators_config")
    if not isinstance(spec, Mapping):
        return [*problems, "speculators_config is missing"]
    if spec.get("algorithm") != "eagle3":
        problems.append(f"speculators_config.algorithm must be 'eagle3', got {spec.get('algorithm')!r}")
    methods = spec.get("proposal_methods") or []
    if not methods or not all(isinstance(m, Mapping) and m.get("speculative_tokens") for m in methods):
        problems.append("speculators_config.proposal_methods must list methods with speculative_tokens")
    elif spec.get("default_proposal_method") not in [m.get("proposal_type") for m in methods]:
        problems.append("speculators_config.default_proposal_method names no listed proposal method")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is missing")
    if not isinstance(config.get("transformer_layer_config"), Mapping):
        problems.append("transformer_layer_config is missing")
    if not config.get("eagle_aux_hidden_state_layer_ids"):
        problems.append("eagle_aux_hidden_state_layer_ids is missing")
    # vLLM reads a missing norm_before_residual as true, so absent counts as set.
    if config.get("norm_before_residual", True) is not False:
        problems.append("norm_before_residual must be false for this draft (vLLM defaults it to true)")
    problems += [f"{flag} is set; this draft does not implement it" for flag in _UNSUPPORTED_FLAGS[1:] if config.get(flag)]
    return problems


def from_speculators(
    config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The SGLang-style config and SGLang-named weights of a speculators-format draft."""
    problems = speculators_config_problems(config)
    if problems:
        raise ExportError("speculators config: " + "; ".join(problems))
    layer = config["transformer_layer_config"]
    sglang = {k: layer.get(k) for k in _LAYER_KEYS}
    sglang.update(
        architectures=[SGLANG_ARCHITECTURE],
        model_type=layer.get("model_type"),
        num_hidden_layers=layer.get("num_hidden_layers"),
        draft_vocab_size=config.get("draft_vocab_size"),
        target_hidden_size=config.get("target_hidden_size") or layer.get("hidden_size"),
        torch_dtype=layer.get("torch_dtype") or config.get("torch_dtype"),
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]],
            "use_aux_hidden_state": True,
        },
        eaglescale=dict(config.get("eaglescale") or {}),
    )
    return sglang, from_speculators_weights(weights)
