"""Extraction while generation is still running (`orchestration.overlap: true`).

Extraction already reads its input as "the generation shards marked so far" (docs/DESIGN.md §7): each
pass here lists the pending shards (`ExtractStage.pending_shards`) and runs them with the same
scheduler, leases and per-shard commit protocol as a sequential run, so a shard is extracted
exactly once however the passes and any kill -9 fall. Following ends when

- `generate/_COMPLETE` was seen *before* a listing that found nothing pending: that listing
  was of the final set of shards, so `finish()` can write `extract/_COMPLETE`; or
- generation ended without completing (its stage clock says so, or the caller says so):
  no shard is started after that, the one in flight commits, and the caller reports
  generation's error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tasks.extract.stage import ExtractStage
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import stage_clock_key
from tasks.runfolder.schedule import ShardScheduler, run_one_at_a_time


class GenerationStopped(RuntimeError):
    """Generation ended without `generate/_COMPLETE`: extraction starts no further shard."""


def _generate_clock_since(run: RunFolder, since: float) -> dict[str, Any] | None:
    """Generation's stage clock (stages/generate.json) if that attempt started after `since`:
    it works whether generation runs in this process or as a deployment elsewhere, and an
    earlier attempt's clock (a failed or killed run) does not count."""
    try:
        clock = run.read_json(stage_clock_key("generate"))
    except ValueError:  # torn while being replaced: asked again at the next poll
        return None
    return clock if clock and float(clock.get("started_at") or 0.0) >= since else None


def generation_started_since(run: RunFolder, since: float) -> bool:
    return _generate_clock_since(run, since) is not None


def generation_ended_since(run: RunFolder, since: float) -> bool:
    """Whether a generate stage that started after `since` has ended (completed or failed)."""
    clock = _generate_clock_since(run, since)
    return clock is not None and clock.get("state") != "running"


def follow_generation(
    stage: ExtractStage,
    run_one: Callable[[str], dict[str, Any]],
    poll_s: float,
    generation_ended: Callable[[], bool],
    on_wait: Callable[[dict[str, str]], None] | None = None,
) -> dict[str, str]:
    """Extract generation shards as their markers appear until generation is complete and
    none is pending: returns the failures, shard -> error (a shard that failed is not tried
    again by this run, as in a sequential run). Raises GenerationStopped once generation ended
    without completing and the shard in flight, if any, has ended."""
    failed: dict[str, str] = {}

    def stopped() -> bool:
        # The clock is written after generate/_COMPLETE, so read it first: an ended clock
        # with no _COMPLETE after it means generation failed.
        return generation_ended() and not stage.gen.is_complete()

    def guarded(shard_id: str) -> dict[str, Any]:
        if stopped():
            raise GenerationStopped(f"shard {shard_id} not started: generation ended without generate/_COMPLETE")
        return run_one(shard_id)

    while True:
        # Read before the listing: a listing made after _COMPLETE was seen is the final one.
        complete = stage.gen.is_complete()
        pending = [s for s in stage.pending_shards() if s not in failed]
        if pending:
            # The forecast at prepare() saw the shards marked then (none, on a fresh run):
            # refuse as soon as those marked now project past the limit.
            stage.check_forecast()
            scheduler = ShardScheduler(stage, pending, max_running=1)
            failed.update(run_one_at_a_time(scheduler, guarded, poll_s, on_wait))
            continue
        if complete:
            return failed
        if stopped():
            raise GenerationStopped(
                f"extract: generation ended without generate/_COMPLETE; stopped following it with "
                f"{len(stage.store.committed())} shard(s) extracted (a resume of the run continues)"
            )
        time.sleep(poll_s)
