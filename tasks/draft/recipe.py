"""The training recipe's choices beyond the objective (issue 27): what a checkpoint records of
them, the draft's head and final norm started from the target's, and noise on the aux states.

Each choice is a TrainConfig setting. Before the settings existed the recipe was fixed: AdamW
betas (0.9, 0.95), per-batch loss normalisation, random lm_head, unit norm, no noise; that is
the default still, but for the betas, which the H200's A/B moved to (0.9, 0.999) (BENCHMARKS P11).
A checkpoint records them all (`recipe_record`); a resume with other values is refused, each
difference named (`recipe_differences`), since the resumed run would be neither recipe's run.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from tasks.config import TrainConfig
from tasks.draft.model import Eagle3Draft
from tasks.draft.ttt import Batch

# The settings a resumed run must share with its checkpoint: the optimiser and the objective
# (total_steps stands for epochs / max_steps: it shapes the cosine schedule).
RECIPE_KEYS = (
    "adam_betas", "loss_normalization", "init_lm_head_from_target", "freeze_lm_head",
    "init_norm_from_target", "aux_state_noise", "learning_rate", "weight_decay", "warmup_steps",
    "max_grad_norm", "ttt_steps", "ttt_decay", "batch_tokens", "seed", "objective",
)  # fmt: skip
# What checkpoints written before the record trained with: these were fixed in the code then
# (the rest was configurable and not recorded, so it is not checked for them).
BEFORE_RECORDING = {
    "adam_betas": [0.9, 0.95], "loss_normalization": "batch", "init_lm_head_from_target": False,
    "freeze_lm_head": False, "init_norm_from_target": False, "aux_state_noise": 0.0,
}  # fmt: skip


# Recorded since a later key: what a checkpoint without it trained with (train.init_from: none).
RECORDED_LATER = {"init_from_sha256": None, "objective": "soft_ce"}
_NAMES = {"total_steps": "train.epochs / train.max_steps (total steps)",
          "init_from_sha256": "train.init_from (its weights' sha256)"}  # fmt: skip


def recipe_record(cfg: TrainConfig, total_steps: int, init_from_sha256: str | None = None) -> dict[str, Any]:
    """The recipe as a checkpoint's trainer state keeps it (JSON values); `init_from_sha256`: the
    starting draft's weights (tasks/draft/starting_draft.py), None for random ones."""
    dumped = cfg.model_dump(mode="json")
    return {**{key: dumped[key] for key in RECIPE_KEYS}, "total_steps": total_steps,
            "init_from_sha256": init_from_sha256}  # fmt: skip


def recipe_differences(recorded: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """'train.KEY: checkpoint A, this run B' for each recorded setting this run changes."""
    recorded = {**RECORDED_LATER, **(BEFORE_RECORDING if recorded is None else recorded)}
    out = []
    for key, then in recorded.items():
        now = current.get(key)
        if then != now:
            out.append(f"{_NAMES.get(key, f'train.{key}')}: checkpoint {then!r}, this run {now!r}")
    return out


def loss_denominator(cfg: TrainConfig) -> float | None:
    """TTTModel's loss_denominator for train.loss_normalization: None (each step's mean over
    the batch's counted tokens) or train.batch_tokens (a fixed one: every token weighs alike)."""
    return None if cfg.loss_normalization == "batch" else float(cfg.batch_tokens)


def start_from_target(
    draft: Eagle3Draft,
    target_lm_head: torch.Tensor,
    draft_ids: torch.Tensor,
    target_norm: torch.Tensor | None,
    cfg: TrainConfig,
) -> None:
    """train.init_lm_head_from_target / freeze_lm_head / init_norm_from_target, in place:
    lm_head row i = the target's row for draft token i (target id draft_ids[i] = i + d2t[i]);
    the norm weight = the target's final norm weight. Call after set_vocab, before the
    optimizer is built (a frozen head must not be among its parameters)."""
    with torch.no_grad():
        if cfg.init_lm_head_from_target:
            rows = target_lm_head.index_select(0, draft_ids.to(torch.int64).to(target_lm_head.device))
            draft.lm_head.weight.copy_(rows.to(draft.lm_head.weight))
        if cfg.init_norm_from_target:
            if target_norm is None:
                raise ValueError("train.init_norm_from_target: no target norm weight given")
            draft.norm.weight.copy_(target_norm.to(draft.norm.weight))
    draft.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)


def with_aux_noise(batch: Batch, std: float, seed: int, step: int, rank: int = 0) -> Batch:
    """The batch with N(0, std^2) added to its aux states (step 0's input; padding too, which
    no counted position reads). Drawn from a generator seeded by (seed, step, rank) alone, so a
    resumed run draws what the uninterrupted one did and no other randomness moves."""
    if std == 0.0:
        return batch
    aux = batch.aux_hidden
    key = hashlib.sha256(f"eaglescale-aux-noise:{seed}:{step}:{rank}".encode()).digest()
    generator = torch.Generator(device=aux.device)
    generator.manual_seed(int.from_bytes(key[:8], "little") >> 1)
    noise = torch.randn(aux.shape, generator=generator, device=aux.device, dtype=aux.dtype)
    return Batch(batch.input_ids, batch.loss_mask, aux + noise * std, batch.last_hidden, batch.lengths)
