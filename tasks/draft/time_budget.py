"""train.time_budget_s: how long the train stage may train before it stops at a checkpoint.

The trainer asks at each checkpoint whether the next scheduled one (the next multiple of
train.save_every, or the last step) would still be reached within the budget at the pace it has
measured since its loop began (steps, evaluations and saves together); when it would not, it
stops there, and a later run resumes that checkpoint exactly. So the first checkpoint is always
reached, and a stop leaves at most one checkpoint interval of the budget unused. The train stage
shares one budget between the run's draft and its data-scaling drafts (tasks/train/stage.py)."""

from __future__ import annotations

from time import monotonic


class TimeBudget:
    """Seconds of training allowed from when it was made; None: no limit."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.started = monotonic()
        self._pace_from = (self.started, 0)

    def pace_from(self, step: int) -> None:
        """The loop starts at `step` now: the pace is measured from here (set-up excluded)."""
        self._pace_from = (monotonic(), step)

    def next_checkpoint_fits(self, step: int, next_step: int) -> bool:
        """Whether training on from `step` to `next_step` at the measured pace ends within it."""
        if self.seconds is None:
            return True
        began, first = self._pace_from
        now = monotonic()
        per_step = (now - began) / max(1, step - first)
        return now + per_step * (next_step - step) <= self.started + self.seconds
