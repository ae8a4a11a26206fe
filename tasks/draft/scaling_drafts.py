"""Data-scaling drafts: the same training on fractions of the training split, for the curve of
acceptance against training samples that the gate measures (train.scaling_fractions).

Each fraction trains in a folder of its own, `train/scaling/frac-<samples>/` (checkpoints,
best.json, result.json: the train stage's layout, one level down, so none resumes another and a
crash resumes each exactly like the main draft), on the first <samples> training sequences with
the full draft's vocabulary map, and is exported to `train/scaling/frac-<samples>/final` in
SGLang's format. `train/scaling/index.json`
lists the finished ones, each with the settings it trained with; the gate reads only that. A
draft the index lists, exported and trained with this run's settings, is not loaded again (a
later session's node has its export and record, not its checkpoints). A draft that
train.time_budget_s stops is not exported, the fractions after it wait for the next run, and the
index names it (`stopped_for_budget`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_VOCAB_MAP

if TYPE_CHECKING:
    from tasks.config import TrainConfig

SCALING_TRAIN_ROOT = "train/scaling"
SCALING_INDEX = f"{SCALING_TRAIN_ROOT}/index.json"
# What a finished draft's index entry records of its settings beside the recipe a resume must
# share (tasks/draft/recipe.py's RECIPE_KEYS): what sizes its schedule and its head.
SCHEDULE_SETTINGS = ("epochs", "max_steps", "draft_vocab_size", "hidden_states")


class TrainElsewhere(RunFolder):
    """The run with its train/ keys under another prefix, on the same extract data. Every
    RunFolder method resolves keys through path(), so this one override redirects them all."""

    def __init__(self, run: RunFolder, prefix: str) -> None:
        self.__dict__.update(vars(run))
        self.prefix = prefix.strip("/")

    def path(self, rel: str) -> str:
        rel = rel.strip("/")
        if rel == "train" or rel.startswith("train/"):
            rel = f"{self.prefix}/{rel.removeprefix('train').lstrip('/')}".rstrip("/")
        return super().path(rel)


def fraction_samples(n_train: int, fractions: Sequence[float]) -> list[tuple[float, int]]:
    """(fraction, training sequences) per distinct fraction, at least one sequence each."""
    if any(not 0 < f < 1 for f in fractions):
        raise ValueError(f"scaling fractions must lie in (0, 1), got {list(fractions)}")
    return [(f, max(1, round(f * n_train))) for f in sorted(set(fractions))]


def train_scaling_drafts(
    run: RunFolder, cfg: TrainConfig, target_model_path: str, **train_kwargs: Any
) -> list[dict[str, Any]]:
    """Train, resume or skip each fraction of `cfg.scaling_fractions`; export each best
    checkpoint; write and return the index (one entry per fraction)."""
    from tasks.draft import checkpoint as ckpt
    from tasks.draft.data import DATA_META_KEY, training_data_metadata
    from tasks.draft.distributed import Dist
    from tasks.draft.export import export_to_run
    from tasks.draft.recipe import RECIPE_KEYS
    from tasks.draft.trainer import TrainResult, train_draft
    from tasks.draft.vocab import VocabMap

    rank = Dist.current()  # under torchrun every rank trains; rank 0 exports and writes the index
    full = training_data_metadata(run)
    n_train = int(full["splits"].get("train", 0))
    if n_train == 0:
        raise ValueError(f"{run.url}: the training data has no training sequences")
    # Every fraction drafts over the full draft's vocabulary: the drafts differ in their training
    # data only (and no fraction re-counts the whole training split for a map of its own).
    vocab = VocabMap.load(run) if run.exists(TRAIN_VOCAB_MAP) else None
    listed = {d["samples"]: d for d in scaling_drafts(run)}
    entries, stopped = [], None
    for fraction, samples in fraction_samples(n_train, cfg.scaling_fractions):
        prefix = f"{SCALING_TRAIN_ROOT}/frac-{samples}"
        view = TrainElsewhere(run, prefix)
        # The same recipe on less data: the same epochs, so the schedule's length (and with it
        # the warm-up, and max_steps when set) scales with the fraction.
        scaled = cfg.model_copy(update={
            "warmup_steps": max(1, round(cfg.warmup_steps * fraction)) if cfg.warmup_steps else 0,
            "max_steps": max(1, round(cfg.max_steps * fraction)) if cfg.max_steps else None,
        })  # fmt: skip
        final = f"{prefix}/final"
        dumped = scaled.model_dump(mode="json")
        settings = {key: dumped[key] for key in (*RECIPE_KEYS, *SCHEDULE_SETTINGS)}
        before = listed.get(samples)
        if before is not None and before.get("settings") == settings and run.exists(f"{final}/config.json"):
            entries.append(before)  # finished on these settings: its export and record stand
            continue

        def ship(result: TrainResult, view: RunFolder = view, final: str = final, samples: int = samples) -> None:
            """The best checkpoint (the last without an evaluation) exported to `final`."""
            best = result.best or {}
            chosen = ckpt.checkpoint_key(best["step"]) if best.get("step") is not None else result.last_checkpoint
            if chosen is None:
                raise RuntimeError(f"{run.url}/{view.prefix}: training at {samples} samples left no checkpoint")
            export_to_run(ckpt.load_run_checkpoint_model(view, chosen), run, final)

        # The curve's points are replayed on the full draft's held-out split: each trains without it.
        result = train_draft(view, scaled, target_model_path, vocab_map=vocab, max_train_sequences=samples,
                             split_of=(full.get("holdout"), f"{run.url}/{DATA_META_KEY}: the full draft"),
                             export=ship, **train_kwargs)  # fmt: skip
        if result.stopped_for_budget:  # its checkpoint is resumed by the next run, and the rest trained then
            stopped = prefix
            break
        entries.append({"fraction": fraction, "samples": samples, "steps": result.steps,
                        "best": result.best or None, "final": final, "settings": settings})  # fmt: skip
    if rank.rank == 0:
        index = {"train_sequences": n_train, "drafts": entries}
        run.write_json_atomic(SCALING_INDEX, {**index, "stopped_for_budget": stopped} if stopped else index)
    return entries


def scaling_drafts(run: RunFolder) -> list[dict[str, Any]]:
    """The finished scaling drafts the train stage listed (none when it trained none)."""
    index = run.read_json(SCALING_INDEX)
    return list(index["drafts"]) if index else []


def scaling_stopped_for_budget(run: RunFolder) -> str | None:
    """The scaling draft (its train/ prefix) train.time_budget_s stopped in the last run that
    trained them, None when that run finished them all."""
    return (run.read_json(SCALING_INDEX) or {}).get("stopped_for_budget")
