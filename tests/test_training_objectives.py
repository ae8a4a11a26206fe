"""docs/TRAINING.md's "How to add a training objective" walked through as written: the page's
example rows function, registered as its steps say, has autograd's gradient and trains a draft;
an unknown objective is refused before any data is read; the default is the checkpoint's record."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from tasks.draft import objectives
from tasks.draft.objectives import OBJECTIVES, Objective, soft_ce_rows
from tasks.draft.train_setup import TrainError
from tasks.draft.trainer import train_draft

DOC = Path(__file__).resolve().parents[1] / "docs" / "TRAINING.md"


def _doc_rows() -> types.FunctionType:
    """Step 1's function, as the page writes it, defined where objectives.py would hold it."""
    text = DOC.read_text()
    section = text[text.index("## How to add a training objective") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace = {"torch": torch}
    exec(compile("\n".join(line.removeprefix("   ") for line in code.group(1).splitlines()), str(DOC), "exec"), namespace)
    return namespace["top1_ce_rows"]


@pytest.fixture
def top1_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 2: its row of OBJECTIVES."""
    monkeypatch.setitem(OBJECTIVES, "top1_ce", Objective("top1_ce", _doc_rows(), "cross-entropy against the target's argmax"))


@pytest.mark.parametrize("name", ["soft_ce", "top1_ce"])
def test_a_rows_function_returns_autograd_s_gradient_of_its_weighted_loss(name: str, top1_registered: None) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g, dtype=torch.float64)
    probs = torch.softmax(torch.randn(9, 11, generator=g, dtype=torch.float64), -1).float()
    index, weight = torch.tensor([0, 3, 3, 5, 8, 1]), torch.rand(6, generator=g, dtype=torch.float64)
    loss, grad = objectives.objective(name).rows(logits, probs, index, weight)
    z = logits.clone().requires_grad_(True)
    again, _ = objectives.objective(name).rows(z, probs, index, weight)
    (again * weight).sum().backward()
    assert loss.shape == (6,) and torch.allclose(grad, z.grad, atol=1e-6)
    if name == "top1_ce":  # a one-hot teacher: zero loss where the draft is sure of the argmax
        sure = torch.full((1, 11), -30.0, dtype=torch.float64)
        sure[0, probs[3].argmax()] = 30.0
        assert objectives.objective(name).rows(sure, probs, torch.tensor([3]), torch.ones(1))[0].item() < 1e-6


def test_the_page_s_objective_trains_a_draft(make_run, top1_registered: None) -> None:
    """Step 3: `train.objective: top1_ce`; the draft learns (the loss falls) and the checkpoint
    records the objective it trained with."""
    cfg, run = make_run("top1", max_steps=12, eval_every=6, save_every=6, objective="top1_ce")
    result = train_draft(run, cfg.train, cfg.target.model_path)
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    from tasks.draft import checkpoint as ckpt

    assert ckpt.read_trainer_state(run, result.last_checkpoint)["recipe"]["objective"] == "top1_ce"
    # Resumed under another objective: refused, naming it.
    cfg2 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"objective": "soft_ce", "max_steps": 14})})
    with pytest.raises(TrainError, match="train.objective: checkpoint 'top1_ce', this run 'soft_ce'"):
        train_draft(run, cfg2.train, cfg.target.model_path)


def test_an_unknown_objective_is_refused_before_any_data_is_read(make_run) -> None:
    cfg, run = make_run("unknown", objective="reverse_kl")
    with pytest.raises(TrainError, match=r"train.objective 'reverse_kl' is not one of \['soft_ce'\].*docs/TRAINING.md"):
        train_draft(run, cfg.train, cfg.target.model_path)
    assert not run.exists("train")  # nothing written


def test_the_default_is_the_eagle3_soft_cross_entropy() -> None:
    assert OBJECTIVES["soft_ce"].rows is soft_ce_rows and list(OBJECTIVES) == ["soft_ce"]
