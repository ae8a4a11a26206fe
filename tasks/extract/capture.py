"""Which target hidden states an EAGLE-3 draft is fed, and the interface of a capture backend.

The layer-id convention lives here and nowhere else (docs/DESIGN.md §7). A draft config's
`eagle_config.eagle_aux_hidden_state_layer_ids` names layer OUTPUTS: id i is the residual
stream after decoder layer i, which is HF's `output_hidden_states[i + 1]`. The default is
[1, L//2 - 1, L - 4] ([1, 29, 57] for a 61-layer target, [1, 3, 4] for the 8-layer tiny one).

How SGLang gets the same tensors depends on the family: each family module in
tasks/target/families/ says how SGLang captures (`TargetFamily.sglang_capture`) and where in
SGLang's source that was read. Llama's way, "next_layer_input": SGLang stores
`layers_to_capture = [i + 1 for i in ids]` and keeps the residual entering layer i + 1, the
output of layer i, and without ids picks `[2, L//2, L - 3]`, the inputs of those layers = our
default outputs. Consequence: id L - 1 (the last layer's output) is unreachable there, since no
layer L exists to capture its input; ids are refused above L - 2. "after_layer" (DeepSeek-V4):
no + 1 and explicit ids only, so `aux_capture_layers` picks no default. A family whose capture
has not been read gets no default either; a model_type no family knows is refused, naming the
known ones.
"""

from __future__ import annotations

from typing import Protocol

from tasks.errors import ExpectedFailure
from tasks.extract.local_capture import CapturedStates
from tasks.target.families.base import SGLangCapture
from tasks.target.families.registry import HOW_TO_ADD, family_for

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


class LayerIdError(ValueError, ExpectedFailure):
    """Aux layer ids that SGLang would not capture, or a target without a default."""


def _capture(model_type: str) -> SGLangCapture:
    """How SGLang captures this family's aux states (its family module says); an unknown
    model_type is the registry's UnknownTargetFamily."""
    capture = family_for(model_type, "EAGLE-3's aux layers").sglang_capture
    if capture is None:
        raise LayerIdError(
            f"model_type {model_type!r}: how SGLang captures its EAGLE-3 hidden states has not been "
            f"read, so eaglescale picks no aux layers for it (its family module's sglang_capture; {HOW_TO_ADD})"
        )
    return capture


def aux_capture_layers(model_type: str, num_layers: int) -> list[int]:
    """EAGLE-3's default aux layer ids (output-of-layer convention) for a target."""
    if _capture(model_type) == "after_layer":
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
    # next_layer_input families capture the input of layer i + 1, which must exist.
    highest = num_layers - 1 if _capture(model_type) == "after_layer" else num_layers - 2
    bad = [i for i in layer_ids if not 0 <= i <= highest]
    if bad:
        problems.append(f"ids {bad} outside [0, {highest}] for a {num_layers}-layer target")
    if problems:
        raise LayerIdError(
            f"aux layer ids {list(layer_ids)} for model_type {model_type!r}: " + "; ".join(problems)
        )


def sglang_layers_to_capture(model_type: str, layer_ids: list[int]) -> list[int]:
    """What SGLang stores in `model.layers_to_capture` for these (output-convention) ids."""
    if _capture(model_type) == "after_layer":
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
