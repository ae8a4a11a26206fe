"""train.time_budget_s: the train stage stops at a checkpoint once the next one would come past
the budget at the measured pace, exports nothing and says so; a later run resumes that checkpoint
to the same weights as a run never stopped. The clock is the test's: one second a training step,
nothing for the set-up, evaluations or saves, so where training stops is exact."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load as st_load

from tasks.draft import checkpoint as ckpt
from tasks.draft import time_budget
from tasks.draft.scaling_drafts import SCALING_INDEX, scaling_drafts
from tasks.draft.time_budget import TimeBudget
from tasks.draft.trainer import TrainCallbacks
from tasks.runfolder.layout import TRAIN_FINAL, TRAIN_FINAL_SPECULATORS, TRAIN_RESULT
from tasks.train.stage import run_train_stage

# Checkpoints at 8 (the first evaluation after step 0 is the best so far), 10, 16 or so, 20, 24.
STEPS = {"max_steps": 24, "eval_every": 8, "save_every": 10}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def step_clock(monkeypatch):
    """The budget's clock, advanced one second by every training step (the on_step callback)."""
    now = [0.0]
    monkeypatch.setattr(time_budget, "monotonic", lambda: now[0])

    def tick(_record: dict) -> None:
        now[0] += 1.0

    return TrainCallbacks(on_step=tick)


def _without_budget(cfg):
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"time_budget_s": None})})


def _weights(run, key: str) -> dict[str, torch.Tensor]:
    return st_load(run.read_bytes(f"{key}/model.safetensors"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_the_budget_stops_at_a_checkpoint_and_a_resume_ends_where_an_unstopped_run_does(make_run, step_clock, caplog):
    cfg, run = make_run("straight", **STEPS)
    straight = run_train_stage(cfg)
    assert straight.result["steps"] == 24 and straight.result["stopped_for_budget"] is False

    # 15 s: at step 8 the next checkpoint (10) fits, at step 10 the next (20) would end at 20 s.
    cfg2, run2 = make_run("budgeted", time_budget_s=15, **STEPS)
    with caplog.at_level(logging.INFO, logger="tasks.draft.trainer"):
        stopped = run_train_stage(cfg2, step_clock)
    assert stopped.summary == {"steps": 10, "last_checkpoint": ckpt.checkpoint_key(10), "stopped_for_budget": "train"}
    assert stopped.exported == {} and stopped.result["stopped_for_budget"] is True
    assert not run2.exists(TRAIN_FINAL) and not run2.exists(TRAIN_FINAL_SPECULATORS)
    assert ckpt.latest_checkpoint(run2) == ckpt.checkpoint_key(10)
    assert f"stopped for train.time_budget_s (15.0 s) at step 10 of 24; {run2.url}/{ckpt.checkpoint_key(10)}" in caplog.text

    resumed = run_train_stage(_without_budget(cfg2))
    assert resumed.result["resumed_from"] == ckpt.checkpoint_key(10) and resumed.result["steps"] == 24
    assert resumed.result["stopped_for_budget"] is False
    assert [h["loss"] for h in resumed.result["history"]] == [h["loss"] for h in straight.result["history"]]
    _same(_weights(run2, ckpt.checkpoint_key(24)), _weights(run, ckpt.checkpoint_key(24)))
    _same(_weights(run2, TRAIN_FINAL), _weights(run, TRAIN_FINAL))
    assert resumed.summary["best_step"] == straight.summary["best_step"]


def test_the_first_checkpoint_is_reached_whatever_the_budget(make_run, step_clock):
    cfg, run = make_run("tiny-budget", time_budget_s=0.5, **STEPS)
    outcome = run_train_stage(cfg, step_clock)
    assert outcome.summary["stopped_for_budget"] == "train" and outcome.summary["steps"] == 8
    assert run.read_json(TRAIN_RESULT)["last_checkpoint"] == ckpt.checkpoint_key(8)


def test_the_scaling_drafts_share_the_budget_and_one_stopped_is_neither_exported_nor_listed(make_run, step_clock):
    """The run's draft (12 steps) ends within 15 s; its scaling draft (6 steps, from 12 s on)
    stops at its step-4 checkpoint: step 6 would end at 18 s. The next run finishes it."""
    steps = {"max_steps": 12, "eval_every": 4, "save_every": 4, "scaling_fractions": [0.5]}
    cfg, run = make_run("scaling-straight", **steps)
    run_train_stage(cfg)
    cfg2, run2 = make_run("scaling-budgeted", time_budget_s=15, **steps)
    stopped = run_train_stage(cfg2, step_clock)
    (entry,) = scaling_drafts(run)
    prefix = entry["final"].removesuffix("/final")
    assert stopped.summary["stopped_for_budget"] == prefix and stopped.summary["steps"] == 12
    assert stopped.exported == {} and not run2.exists(TRAIN_FINAL) and not run2.exists(entry["final"])
    assert run2.read_json(SCALING_INDEX) == {"train_sequences": run2.read_json("train/data.json")["splits"]["train"],
                                             "drafts": [], "stopped_for_budget": prefix}  # fmt: skip

    resumed = run_train_stage(_without_budget(cfg2))
    assert "stopped_for_budget" not in resumed.summary and resumed.summary["scaling_drafts"] == [entry["samples"]]
    assert run2.read_json(f"{prefix}/result.json")["resumed_from"] == ckpt.checkpoint_key(4)  # keys of its own train/ view
    _same(_weights(run2, entry["final"]), _weights(run, entry["final"]))
    _same(_weights(run2, TRAIN_FINAL), _weights(run, TRAIN_FINAL))


def test_the_pace_is_measured_from_the_loop_and_reaches_the_next_checkpoint(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time_budget, "monotonic", lambda: now[0])
    budget = TimeBudget(60)
    now[0] = 130.0  # 30 s of set-up: spent, but no part of the pace
    budget.pace_from(4)
    now[0] = 140.0  # 6 steps in 10 s
    assert budget.next_checkpoint_fits(10, 20)  # 140 + 16.7 <= 160
    assert not budget.next_checkpoint_fits(10, 24)  # 140 + 23.3 > 160
    assert TimeBudget(None).next_checkpoint_fits(10, 10**9)
