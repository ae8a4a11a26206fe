"""The train stage, composed once for every way it runs: `eaglescale run` (flows/train.py, in
process or through torchrun) and each torchrun rank (tasks/train/main.py).

Every draft it trains (the run's draft, then the data-scaling drafts of train.scaling_fractions)
trains on the run's own store (run_root with its storage_options) and, when train.hidden_states
is online, with the target that makes the states as it goes. Then the best checkpoint is
exported to train/final (SGLang's EAGLE3 format) and train/final-speculators (vLLM's), unless
train.time_budget_s stopped a draft at a checkpoint: then nothing is exported, the outcome names
the draft stopped, and the next run resumes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tasks.draft.data import training_data_metadata
from tasks.draft.export import export_run_draft
from tasks.draft.forecast import FORECAST_KEY, forecast_reference
from tasks.draft.online import OnlineTarget
from tasks.draft.scaling_drafts import (
    scaling_drafts,
    scaling_stopped_for_budget,
    train_scaling_drafts,
)
from tasks.draft.time_budget import TimeBudget
from tasks.draft.trainer import TrainCallbacks, TrainResult, train_draft
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_RESULT

if TYPE_CHECKING:
    from tasks.config import EagleScaleConfig


@dataclass
class TrainOutcome:
    result: dict[str, Any]  # train/result.json: the draft's steps, evals and best
    exported: dict[str, Any]  # export_run_draft's: the best checkpoint and where it was exported ({}: none)
    summary: dict[str, Any]  # the stage's key numbers (its completion message)


def _run_and_target(config: EagleScaleConfig) -> tuple[RunFolder, OnlineTarget | None]:
    return RunFolder(config.run_root, config.storage_options), OnlineTarget.from_config(config)


def train_scaling(config: EagleScaleConfig, fractions: Sequence[float] | None = None,
                  callbacks: TrainCallbacks | None = None, budget: TimeBudget | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The data-scaling drafts alone: those of `fractions` (default train.scaling_fractions).
    The index it writes lists only these; the stage, run after, writes the whole one. `budget`:
    the train stage's time budget, shared with the run's draft (default: train.time_budget_s)."""
    run, online = _run_and_target(config)
    train = config.train if fractions is None else config.train.model_copy(update={"scaling_fractions": list(fractions)})
    return train_scaling_drafts(run, train, config.target.model_path, callbacks=callbacks, online=online,
                                budget=budget)  # fmt: skip


def train_drafts(config: EagleScaleConfig, callbacks: TrainCallbacks | None = None) -> TrainResult | None:
    """Train (or resume) the run's draft, then its data-scaling drafts when train.scaling_fractions
    names any, within one train.time_budget_s counted from here (a draft it stops leaves those
    after it to the next run). With train.forecast_full_draft the scaling drafts come first and
    the full draft's forecast is written before it trains (forecast_then_train; None: a scaling
    draft stopped for the budget). Under torchrun every rank calls this; rank 0 writes what they
    share."""
    run, online = _run_and_target(config)
    budget = TimeBudget(config.train.time_budget_s)
    if config.train.forecast_full_draft:
        return forecast_then_train(config, run, online, callbacks, budget)
    result = train_draft(run, config.train, config.target.model_path, callbacks=callbacks, online=online,
                         budget=budget)  # fmt: skip
    if config.train.scaling_fractions and not result.stopped_for_budget:  # the data-scaling drafts the gate measures
        train_scaling(config, callbacks=callbacks, budget=budget)
    return result


def forecast_then_train(config: EagleScaleConfig, run: RunFolder, online: OnlineTarget | None,
                        callbacks: TrainCallbacks | None, budget: TimeBudget) -> TrainResult | None:  # fmt: skip
    """The pre-registered order: the full draft's vocabulary map and data record, the scaling
    drafts on them, the forecast from their curve (tasks/draft/forecast.py), then the full draft,
    its result naming the forecast, and the forecast set beside what it reached."""
    from tasks.draft.distributed import Dist
    from tasks.draft.forecast import check_forecast, write_forecast
    from tasks.draft.trainer import Trainer, TrainOptions

    options = TrainOptions(callbacks=callbacks, online=online, budget=budget)
    if not run.exists(TRAIN_RESULT):  # the full draft has not started: what it shares comes first
        Trainer(run, config.train, config.target.model_path, options).record_data()
        drafts = train_scaling(config, callbacks=callbacks, budget=budget)
        if scaling_stopped_for_budget(run):
            return None
        if Dist.current().rank == 0:
            write_forecast(run, drafts, int(training_data_metadata(run)["splits"]["train"]))
        Dist.current().barrier()
    result = train_draft(run, config.train, config.target.model_path, options)
    if Dist.current().rank == 0 and not result.stopped_for_budget:
        recorded = {**(run.read_json(TRAIN_RESULT) or {}), "forecast": forecast_reference(run.read_json(FORECAST_KEY))}
        run.write_json_atomic(TRAIN_RESULT, recorded)
        check_forecast(run, recorded)
    return result


def stopped_for_budget(run: RunFolder, config: EagleScaleConfig) -> str | None:
    """The draft (its train/ prefix) train.time_budget_s stopped in the last training, read from
    the run folder (a torchrun launch's ranks wrote it); None when every draft finished."""
    if (run.read_json(TRAIN_RESULT) or {}).get("stopped_for_budget"):
        return "train"
    return scaling_stopped_for_budget(run) if config.train.scaling_fractions else None


def run_train_stage(
    config: EagleScaleConfig,
    callbacks: TrainCallbacks | None = None,
    *,
    train: Callable[[EagleScaleConfig], object] | None = None,
    hold: AbstractContextManager[Any] | None = None,
) -> TrainOutcome:
    """The whole stage: the drafts trained while `hold` is held (the flow's GPU slots; export
    needs none), then the best checkpoint exported, unless the time budget stopped a draft (the
    summary's `stopped_for_budget` names it). `train` trains them elsewhere (the flow's torchrun
    launch, whose every rank runs train_drafts); by default train_drafts runs here, with
    `callbacks`."""
    with hold or nullcontext():
        if train is None:
            train_drafts(config, callbacks)
        else:
            train(config)
    run = RunFolder(config.run_root, config.storage_options)
    result = run.read_json(TRAIN_RESULT) or {}
    stopped = stopped_for_budget(run, config)
    if stopped is not None:
        summary = {"steps": result.get("steps"), "last_checkpoint": result.get("last_checkpoint"),
                   "stopped_for_budget": stopped}  # fmt: skip
        return TrainOutcome(result, {}, summary)
    exported = export_run_draft(run, config.target.model_path)
    best = exported["best"]
    summary = {
        "steps": result.get("steps"),
        "best_step": best.get("step"),
        "best_sim_accept_len": best.get("sim_accept_len"),
        "final": exported["final"],
        "scaling_drafts": [d["samples"] for d in scaling_drafts(run)],
    }
    return TrainOutcome(result, exported, summary)
