"""`train.init_from`: the exported draft a run starts from instead of random weights.

A data-scaling run that grows its data can continue the draft it shipped (the train stage's
final/, or a registry's promoted draft) rather than train one from nothing. The draft is read and
checked before any data is indexed or any target loaded: its shape and the target it was made
for must be this run's (each difference named), and its vocabulary map becomes the run's, since
its head's rows are in that map's order. Its weights' digest goes into every checkpoint's recipe
record, so a resume from another start is refused (tasks/draft/recipe.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from tasks.draft.architecture import DraftConfig
from tasks.draft.export import ExportError, draft_config_from_sglang, read_exported
from tasks.draft.vocab import VocabMap

# What must agree between the starting draft and the one this run builds for its target: every
# weight's shape follows from these, and the rest decides what the weights compute.
MATCHING_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "draft_vocab_size", "aux_layer_ids", "target_hidden_size", "target_num_layers",
    "target_model_type", "rms_norm_eps", "rope_theta", "hidden_act",
)  # fmt: skip


class StartingDraftError(ValueError):
    """train.init_from names no exported draft, or one that does not fit this run."""


@dataclass(frozen=True)
class StartingDraft:
    source: str
    weights: dict[str, torch.Tensor]  # the exportable tensors, SGLang's names (d2t and t2d among them)
    vocab: VocabMap
    sha256: str  # of the tensors as read: names, dtypes, shapes and bytes


def tensors_sha256(weights: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}:".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def read_starting_draft(source: str, draft_cfg: DraftConfig) -> StartingDraft:
    """The exported draft at `source` (SGLang or speculators format), checked against the draft
    this run builds (`draft_cfg`, from its target and train settings)."""
    try:
        config, weights, _ = read_exported(source)
    except (ExportError, FileNotFoundError, ValueError) as err:
        raise StartingDraftError(f"train.init_from {source}: {err}") from err
    theirs = draft_config_from_sglang(config)
    differences = [f"{key} {getattr(theirs, key)!r} where this run's is {getattr(draft_cfg, key)!r}"
                   for key in MATCHING_FIELDS if getattr(theirs, key) != getattr(draft_cfg, key)]  # fmt: skip
    if differences:
        raise StartingDraftError(
            f"train.init_from {source}: that draft does not fit this run's target and train settings: "
            + "; ".join(differences) + " (train.draft_vocab_size and train.intermediate_size set two of them)"
        )
    try:
        vocab = VocabMap.from_tensors(weights["d2t"], weights["t2d"], where=f"train.init_from {source}")
    except (KeyError, ValueError) as err:
        raise StartingDraftError(f"train.init_from {source}: no usable vocabulary map ({err})") from err
    return StartingDraft(source, weights, vocab, tensors_sha256(weights))
