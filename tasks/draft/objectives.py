"""The draft's training objectives: how one counted row's loss is taken against the target.

Every objective is a rows function, `rows(logits, probs, index, weight) -> (loss, grad)`:
- `logits` [R, draft_vocab]: the draft's logits at R counted rows (any float dtype);
- `probs` [N, draft_vocab] float32: the target's distribution over the draft vocabulary at every
  position of the batch (tasks/draft/ttt.py compute_teacher), and `index` [R]: each row's position
  in it (the teacher of a row k steps ahead sits k positions on);
- `weight` [R]: each row's weight in the batch's loss (the step's decay over its normaliser);
- `loss` [R] float32: the row's unweighted loss (the per-step statistics sum these);
- `grad` [R, draft_vocab] in the logits' dtype: d(weight[i] * loss[i]) / d logits[i], made in the
  forward pass (tasks/draft/ttt.py SoftCrossEntropy keeps only it, not fp32 logits, for the
  backward; rows go in chunks to bound the fp32 temporaries).

An objective is one function and one row of OBJECTIVES; `train.objective` names it, a checkpoint
records it (tasks/draft/recipe.py), and docs/TRAINING.md walks through adding one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

RowsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def soft_ce_rows(
    logits: torch.Tensor, probs: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy against the target's whole distribution (EAGLE-3's): per row
    logsumexp(z) - p.z in fp32, its gradient (softmax(z) - p) * weight in the logits' dtype.
    Compiled, the gather and every pass fuse into two kernels."""
    z = logits.float()
    p = probs.index_select(0, index).float()
    rows = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    return rows, ((torch.softmax(z, dim=-1) - p) * weight[:, None]).to(logits.dtype)


@dataclass(frozen=True)
class Objective:
    name: str
    rows: RowsFn
    description: str


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective("soft_ce", soft_ce_rows, "cross-entropy against the target's distribution over the draft "
                  "vocabulary (EAGLE-3's objective; its value minus the teacher's entropy is the forward KL)"),
    )
}  # fmt: skip


def objective(name: str) -> Objective:
    """The objective `train.objective` names; a clear error naming the known ones."""
    if name not in OBJECTIVES:
        raise ValueError(f"train.objective {name!r} is not one of {sorted(OBJECTIVES)} (tasks/draft/objectives.py; "
                         "docs/TRAINING.md says how to add one)")  # fmt: skip
    return OBJECTIVES[name]
