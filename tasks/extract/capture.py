"""Which target hidden states an EAGLE-3 draft is fed, and the interface of a capture backend.

The layer-id convention lives here and nowhere else (docs/DESIGN.md §7). A draft config's
`eagle_config.eagle_aux_hidden_state_layer_ids` names layer OUTPUTS: id i is the residual
stream after decoder layer i, which is HF's `output_hidden_states[i + 1]`. The default is
[1, L//2 - 1, L - 4] ([1, 29, 57] for a 61-layer target, [1, 3, 4] for the 8-layer tiny one).

How SGLang gets the same tensors (read from its source, not run here):
- Llama, Qwen and the DeepSeek-V2/V3 family (DeepseekV2ForCausalLM, which also serves
  Kimi-K2 and, through KimiK25ForConditionalGeneration's language model, Kimi-K2.5):
  `set_eagle3_layers_to_capture(ids)` stores `layers_to_capture = [i + 1 for i in ids]`
  and the model appends `hidden_states + residual` on ENTERING layer i + 1, i.e. the
  output of layer i. Newer versions moved that append into the decoder layer
  (`prepare_attn_and_capture_last_layer_outputs`, layers flagged `_is_layer_to_capture`),
  still capturing the residual entering the flagged layer: same tensor. Without ids its
  default is `[2, L//2, L - 3]`, the inputs of those layers = our default outputs.
  Consequence: id L - 1 (the last layer's output) is unreachable there, since no layer L
  exists to capture its input; ids are refused above L - 2.
- DeepSeek-V4 (`deepseek_v4.py`): captures after layer i returns, so SGLang applies no +1,
  and it has no default: explicit ids are required. The ids still name outputs, so the
  tensor is the same, but its mHC residual is collapsed before capture by code we have not
  seen run; `aux_capture_layers` refuses that family rather than guess a default.
"""

from __future__ import annotations

from typing import Protocol

from tasks.extract.local_capture import CapturedStates

__all__ = [
    "AUX_LAYER_COUNT",
    "CaptureBackend",
    "CapturedStates",
    "LayerIdError",
    "aux_capture_layers",
    "sglang_layers_to_capture",
    "validate_aux_layer_ids",
]

AUX_LAYER_COUNT = 3
# SGLang captures these families AFTER layer i (no +1) and has no default ids.
EXPLICIT_IDS_ONLY = frozenset({"deepseek_v4"})
class LayerIdError(ValueError):
    """Aux layer ids that SGLang would not capture, or a target without a default."""


def aux_capture_layers(model_type: str, num_layers: int) -> list[int]:
    """EAGLE-3's default aux layer ids (output-of-layer convention) for a target."""
    if model_type in EXPLICIT_IDS_ONLY:
        raise LayerIdError(
            f"model_type {model_type!r}: SGLang has no default EAGLE-3 capture layers for this "
            "family (it requires explicit eagle_aux_hidden_state_layer_ids); set them explicitly"
        )
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    validate_aux_layer_ids(model_type, ids, num_layers)
    return ids


def validate_aux_layer_ids(model_type: str, layer_ids: list[int], num_layers: int) -> None:
    """Refuse ids that are not three distinct ascending layers SGLang can capture."""
    problems = []
    if len(layer_ids) != AUX_LAYER_COUNT:
        problems.append(f"expected {AUX_LAYER_COUNT} ids, got {len(layer_ids)}")
    if list(layer_ids) != sorted(set(layer_ids)):
        problems.append("ids must be distinct and ascending")
    # +1 families capture the input of layer i + 1, which must exist.
    highest = num_layers - 1 if model_type in EXPLICIT_IDS_ONLY else num_layers - 2
    bad = [i for i in layer_ids if not 0 <= i <= highest]
    if bad:
        problems.append(f"ids {bad} outside [0, {highest}] for a {num_layers}-layer target")
    if problems:
        raise LayerIdError(
            f"aux layer ids {list(layer_ids)} for model_type {model_type!r}: " + "; ".join(problems)
        )


def sglang_layers_to_capture(model_type: str, layer_ids: list[int]) -> list[int]:
    """What SGLang stores in `model.layers_to_capture` for these (output-convention) ids."""
    if model_type in EXPLICIT_IDS_ONLY:
        return list(layer_ids)
    return [i + 1 for i in layer_ids]


class CaptureBackend(Protocol):
    """Runs the target over whole training sequences and returns their hidden states."""

    name: str
    hidden_size: int
    aux_layer_ids: list[int]

    def capture(self, sequences: list[list[int]]) -> list[CapturedStates]:
        """States for each sequence, in input order, on the backend's device."""
        ...

    def close(self) -> None: ...
