"""Resuming a draft's training from its newest complete checkpoint, and every refusal of one.

A checkpoint is resumed only into the run that wrote it: the same hidden-states mode, held-out
split, training sequences, recipe (tasks/draft/recipe.py, total steps included) and vocabulary
map. Each difference is a TrainError naming it and the fix, raised before the weights and the
optimizer load wherever the trainer state alone can tell (a frozen head, say, changes the
optimizer's parameter groups, and loading would fail without naming why). The held-out split a
draft must share with another record (a scaling draft's with its full draft's) is checked here
too: `check_split`."""

from __future__ import annotations

from typing import Any

import torch

from tasks.config import TrainConfig
from tasks.draft import checkpoint as ckpt
from tasks.draft.model import Eagle3Draft
from tasks.draft.recipe import recipe_differences
from tasks.draft.train_setup import TrainData, TrainError
from tasks.extract.sequences import holdout_changed
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_VOCAB_MAP

START_OVER = "or remove train/checkpoints to start over"


def check_split(data: TrainData, recorded: str | None, where: str) -> None:
    """Refuse a held-out split other than the one `where` recorded (holdout_changed); None (a
    record from before the key) is not checked."""
    if data.source is not None:  # online: the split is made here, from the manifest
        changed = holdout_changed(recorded, data.source.builder, where)
    elif None not in (recorded, data.meta.get("holdout")) and recorded != data.meta["holdout"]:
        changed = f"{where} was made with the held-out split {recorded}, the extracted shards hold {data.meta['holdout']}"
    else:
        changed = None
    if changed:
        raise TrainError(changed)


def check_resumable(run: RunFolder, key: str, state: dict[str, Any], cfg: TrainConfig, data: TrainData,
                    recipe: dict[str, Any]) -> None:  # fmt: skip
    """Refuse checkpoint `key` (its trainer state `state`) when this run is not its continuation."""
    where = f"{run.url}/{key}"
    recorded_mode = state.get("hidden_states", "offline")  # checkpoints before the key: offline
    if recorded_mode != cfg.hidden_states:
        raise TrainError(
            f"{where}: trained with train.hidden_states {recorded_mode!r}, this run asks for "
            f"{cfg.hidden_states!r}; resume in {recorded_mode!r} mode, {START_OVER}"
        )
    # A split changed since (extract.holdout_unit, say) would train on what the checkpoint held out.
    check_split(data, state.get("holdout"), where)  # checkpoints before the key: per prompt
    recorded_n = state.get("train_sequences")  # checkpoints before the key: not checked
    if recorded_n is not None and recorded_n != data.train_sequences:
        raise TrainError(
            f"{where}: trained on {recorded_n} training sequences, this run has {data.train_sequences} "
            f"(train.max_train_sequences or the data changed); resume with the same data, {START_OVER}"
        )
    differences = recipe_differences(state.get("recipe"), recipe)
    if differences:
        raise TrainError(f"{where}: trained with another recipe: " + "; ".join(differences)
                         + f"; resume with the checkpoint's settings, {START_OVER}")  # fmt: skip


def resume_checkpoint(run: RunFolder, key: str, cfg: TrainConfig, data: TrainData, recipe: dict[str, Any],
                      draft: Eagle3Draft, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:  # fmt: skip
    """Checkpoint `key`'s weights, optimizer, scheduler and RNG restored in place, once it is
    this run's to resume; returns its trainer state."""
    check_resumable(run, key, ckpt.read_trainer_state(run, key), cfg, data, recipe)
    state = ckpt.load_training_state(run, key, draft, optimizer, scheduler)
    if not torch.equal(draft.d2t.cpu(), data.vocab.d2t):
        raise TrainError(f"{run.url}/{key}: trained with another vocab map than {TRAIN_VOCAB_MAP}; "
                         "remove one of them")
    return state
