"""A draft trained within its session: the train stage run with train.time_budget_s set to the
device time the session has left less what must follow (the product stops it at the last
checkpoint that fits, and a later run resumes that checkpoint exactly); around it, what is the
session's: the draft's epochs fitted beside the gate it prefers, a finished draft packed to
travel (`node drafts K`), a stopped one's checkpoint packed to travel (`node checkpoint K`, then
the next session's `prepare --checkpoint-from`), and train-fit.json saying which."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from gpunode import node_env, travel
from gpunode.gate_session import gate_s
from gpunode.node_env import bytes_under, read_json

# The draft a qwen session trains before it gates it (draft_to_gate), as measured on the node: the
# first step after 91-133 s on run 15's set (the target loaded, the untrained evaluation, the first
# step's torch.compile) and 173 s on the grown set (its index pass and held-out set are ~4x), then
# 0.42-0.51 s a step of 16,384 tokens while each batch's states went GPU -> host -> GPU, 0.228 s
# since they stay on the GPU (BENCHMARKS P16-P19, P24, P26); an evaluation and save 5-7 s on run
# 15's held-out sequences, 9.7 s on the grown set's. The upper ends, with a margin on the new
# pace: a session that planned with a faster pace than it ran at left its gate too little (P18).
# Steps per epoch come from the regenerated tokens: run 15 packed its 3.14 M into 204 batches,
# 1.06x their own count.
QWEN_TRAIN_READY_S = 175.0
QWEN_STEP_S = 0.27
QWEN_EVAL_SAVE_S = 10.0
PACKING_SLACK = 1.1
# What has to fit in the session after the draft's last step: the train stage's export (fp32 and
# vLLM), the bf16 export and the pack, and the calls that bring the draft back (46-78 s to the
# packed draft and ~5 s for the four `node drafts K` calls: BENCHMARKS P16, P18).
TRAIN_TAIL_S = 120.0
# A checkpoint that travels (`node checkpoint K`): packed on the node (tar and parts: it writes
# its bytes twice; 3-4 s on the node, P24, P26, the rest a margin for a slower disk), then brought
# back travel.PARTS_PER_CALL parts a call at travel.SECONDS_PER_CALL each.
CHECKPOINT_PACK_S = 30.0
# What a first checkpoint is taken to weigh before one exists: the Qwen draft's, with its
# optimizer's state, 1.27 GB (BENCHMARKS P20).
CHECKPOINT_BYTES = 1_300_000_000
# A finished data-scaling draft beside a stopped draft's checkpoint (train.forecast_full_draft:
# Packing.scaling_members): exported in bf16 on the node, then brought back; the Qwen draft's bf16
# export is 212 MB, and a draft took 46-78 s from its best checkpoint to its parts (BENCHMARKS
# P16, P18), most of it the export.
DRAFT_BF16_BYTES = 212_000_000
DRAFT_EXPORT_S = 60.0
# `eaglescale run --stages train` starts (its Prefect API, the configuration) before the train
# stage's clock for train.time_budget_s begins.
STAGE_START_S = 30.0


def steps_per_epoch(progress: dict[str, Any], train: dict[str, Any]) -> float:
    """The training steps an epoch of the run's regenerated tokens makes, estimated from the
    generation's token counts (PACKING_SLACK): run 15's 3.14 M tokens, 204 steps packed, ~211 read."""
    tokens = progress["tokens"]
    return PACKING_SLACK * (tokens["prompt_done"] + tokens["completion_done"]) / train["batch_tokens"]


def epochs_need_s(epochs: int, per_epoch: float, train: dict[str, Any], drafts: float, gate: float) -> float:
    """Device seconds for `drafts` full drafts' worth of steps at `epochs` (QWEN_*: side by side
    on one GPU they take about the sum of their times alone, BENCHMARKS P11), their tail, and the
    gate after them."""
    steps = math.ceil(drafts * epochs * per_epoch)
    evals = steps // train["eval_every"] + 1
    return QWEN_TRAIN_READY_S + steps * QWEN_STEP_S + evals * QWEN_EVAL_SAVE_S + TRAIN_TAIL_S + gate


def fit_epochs(per_epoch: float, train: dict[str, Any], drafts: float, gate: float, left: float) -> dict[str, Any]:
    """The profile's epochs, or the most that leave `gate` its time in the `left` seconds: a draft
    that ends with no time to gate it decides nothing, a shorter one does."""
    profile_epochs = int(train["epochs"])
    fitting = [e for e in range(profile_epochs, 0, -1) if epochs_need_s(e, per_epoch, train, drafts, gate) <= left]
    return {"epochs": fitting[0] if fitting else profile_epochs, "profile_epochs": profile_epochs,
            "fits": bool(fitting), "seconds_left": left, "steps_per_epoch_estimate": per_epoch, "drafts": drafts,
            "gate_reserve_s": gate, "needed_s": epochs_need_s(fitting[0] if fitting else 1, per_epoch, train, drafts, gate)}  # fmt: skip


def checkpoint_travel_s(nbytes: int, exports: int = 0) -> float:
    """Device seconds from a stopped draft's last checkpoint to its parts here: the pack (with
    `exports` finished scaling drafts exported beside it), then the `node checkpoint K` calls."""
    total = nbytes + exports * DRAFT_BF16_BYTES
    return CHECKPOINT_PACK_S + exports * DRAFT_EXPORT_S + travel.calls_for(total) * travel.SECONDS_PER_CALL


def train_budget_s(left: float, checkpoint_bytes: int, exports: int = 0) -> float:
    """train.time_budget_s for a draft with `left` device seconds in its session: what is left
    once the stage has started, less what must follow its last training step, whichever way it
    ends (its tail when it finishes, its checkpoint's way back when it stops, with `exports`
    scaling drafts beside it). At least 1: the first checkpoint is always reached."""
    return max(1.0, left - STAGE_START_S - max(TRAIN_TAIL_S, checkpoint_travel_s(checkpoint_bytes, exports)))


def _step_of(key: str | None) -> int:
    return int(key.rsplit("-", 1)[1]) if key else 0


def train_fit(run_root: Path, budget: float | None, reserve_s: float, seconds: float) -> dict[str, Any]:
    """train-fit.json: how the session's training ended, from the train stage's own record (the
    result.json of the draft it trained last: the run's, or the data-scaling draft its budget
    stopped, travel.stopped_draft): finished (exported) or stopped for its time budget at a
    checkpoint that travels, the steps, the pace of a step (the median of its records) and its
    wait for batches."""
    draft = travel.stopped_draft(run_root)
    result = read_json(draft / "result.json") or {}
    stopped = bool(result.get("stopped_for_budget"))
    history = result.get("history") or []
    paces = [h["batch_tokens"] / h["tok_per_s"] for h in history if h.get("tok_per_s")]
    waits = [h["data_wait_s"] for h in history if h.get("data_wait_s") is not None]
    resumed = result.get("resumed_from")
    return {"time_budget_s": budget, "reserve_s": reserve_s, "seconds": seconds, "draft": str(draft.relative_to(run_root)),
            "finished": not stopped and (run_root / "train/final/config.json").is_file(),
            "stopped_at_step": result.get("steps") if stopped else None, "steps": result.get("steps"),
            "total_steps": (result.get("recipe") or {}).get("total_steps"),
            "resumed_from": resumed and Path(resumed).name, "steps_trained": (result.get("steps") or 0) - _step_of(resumed),
            "pace_s": statistics.median(paces) if paces else None,
            "data_wait_s_mean": sum(waits) / len(waits) if waits else None}  # fmt: skip


class TrainingSession:
    def train_in_session(self, env: dict[str, str], reserve_s: float = 0.0) -> None:
        """The full draft trained by the train stage within the session's device time (`node start
        --budget`: train.time_budget_s, train_budget_s), to its end and exported when it gets there,
        else to the last checkpoint whose way back still fits, which is then packed to travel
        (`node checkpoint K`, `prepare --checkpoint-from`) and resumed by the next session's node.
        A draft stopped so also resumes when the pipeline is started again on the same machine.
        With a carried checkpoint the draft trains at its epochs (epochs_carried): the trainer
        refuses a resume on another recipe. `reserve_s`: what follows (its gate), recorded."""
        if self.done_before("train") or (read_json(node_env.NODE / "train-fit.json") or {}).get("finished"):
            return
        if travel.carried()["checkpoint"]:
            self.epochs_carried()
        left = self.seconds_to_deadline()
        newest = travel.newest_checkpoint(self.run_root)
        size = sum(map(bytes_under, travel.checkpoint_members(self.run_root).values())) if newest else CHECKPOINT_BYTES
        train = self.params_data()["train"]
        # Under the forecast's order each scaling draft this node finishes may travel beside the
        # stopped one; those an earlier session finished do not go back (Packing.scaling_members).
        finished = len((read_json(self.run_root / travel.SCALING_INDEX) or {}).get("drafts", []))
        fractions = len(train.get("scaling_fractions") or [])
        exports = max(0, fractions - finished) if train.get("forecast_full_draft") else 0
        budget = None if left is None else round(train_budget_s(left, size, exports))
        began = time.time()
        self.optional(lambda: self._train_stage(env, budget, began), "train")
        fit = train_fit(self.run_root, budget, reserve_s, time.time() - began)
        (node_env.NODE / "train-fit.json").write_text(json.dumps(fit, indent=1))
        self.save_measure("train_fit", fit)
        if fit["stopped_at_step"] is not None:
            self.note("checkpoint-pack", "running")  # timed: what the travel costs on the node
            self.optional(self.pack_run_checkpoint, "checkpoint-pack", mark=True)

    def _train_stage(self, env: dict[str, str], budget: float | None, began: float) -> None:
        """The train stage; its exit for a draft its time budget stopped (at a checkpoint this
        pass saved: the run's draft or a data-scaling one, travel.stopped_draft) is this step's
        end, not a failure."""
        try:
            self.stage("train", *([f"train.time_budget_s={budget}"] if budget else []), env=env)
        except RuntimeError:
            result = travel.stopped_draft(self.run_root) / "result.json"
            if not (result.is_file() and result.stat().st_mtime >= began and (read_json(result) or {}).get("stopped_for_budget")):
                raise
            self.note("train", "stopped", f"train.time_budget_s={budget}: stopped at step {read_json(result)['steps']}; "
                      "its checkpoint travels")  # fmt: skip

    def pack_trained_draft(self) -> bool:
        """A draft the session's training finished: packed to travel (`node drafts K`). False when
        it did not finish."""
        if not (read_json(node_env.NODE / "train-fit.json") or {}).get("finished"):
            return False
        if not self.done_before("draft-pack"):
            self.note("draft-pack", "running")  # timed: what the travel costs on the node
            self.optional(self.pack_run_draft, "draft-pack", mark=True)
        return True

    def draft_to_gate(self) -> bool:
        """The draft a qwen plan gates: the carried one (`prepare --draft-from`), else this run's,
        trained here first as qwen-generate's is and packed (so that `node drafts K` can fetch it
        while the gate runs), or resumed from the checkpoint an earlier session brought back
        (`prepare --checkpoint-from`). False, with status.json's gate step saying why, when it
        stopped at a checkpoint (that checkpoint travels) or its training failed: no gate then."""
        if travel.carried()["draft"]:
            return True
        self.epochs_within_budget()
        self.train_in_session(self.trainer_env(), self.least_gate_s())
        if self.pack_trained_draft():
            return True
        fit = read_json(node_env.NODE / "train-fit.json")
        why = (f"the draft would not have finished in this session (train-fit.json): it stopped at step "
               f"{fit.get('stopped_at_step')}, whose checkpoint travels (`node checkpoint K`, then the next session's "
               "`prepare --checkpoint-from`); `node start` again on this machine also resumes it"
               if fit and fit.get("stopped_at_step") is not None else "no draft: its training failed (logs/stage-train.log)")  # fmt: skip
        self.note("gate", "skipped", why)
        return False

    def epochs_within_budget(self, drafts: float = 1.0, scaling_drafts: int = 0) -> None:
        """Before the drafts a plan trains and then gates (draft_to_gate, qwen_scaling): the
        profile's epochs, or the most that leave the gate it prefers (gate_plan's preferred, each
        of `scaling_drafts` once) its time after `drafts` full drafts' worth of steps (fit_epochs),
        in the device time left. measurements.json's train_epochs says what was chosen and why; a
        restarted pipeline keeps it (its checkpoints were planned for it), and epochs given with
        --set stand."""
        if travel.carried()["checkpoint"]:  # the draft resumes: at the epochs it was started with
            self.epochs_carried()
            return
        chosen = self.measure.get("train_epochs")
        left = self.seconds_to_deadline()
        progress = read_json(self.run_root / "generate/progress.json")
        train = self.params_data()["train"]
        # A schedule in epochs that the profile spells out (a rehearsal's max_steps is its own).
        sized = all(key in train for key in ("epochs", "batch_tokens", "eval_every")) and not train.get("max_steps")
        if chosen is None and ("train", "epochs") not in self.settings and left is not None and progress and sized:
            plan = self.gate_plan(scaling_drafts=scaling_drafts)
            gate = gate_s(plan["trims"][plan["preferred"]])
            chosen = fit_epochs(steps_per_epoch(progress, train), train, drafts, gate, left)
            self.save_measure("train_epochs", chosen)
        if chosen:
            self._train_at(chosen)

    def _train_at(self, chosen: dict[str, Any]) -> None:
        """The epochs measurements.json's train_epochs chose, on params.yaml and every stage's
        --set, where they differ from the profile's."""
        if chosen["epochs"] != chosen["profile_epochs"]:
            self.set_setting("train", "epochs", chosen["epochs"])

    def epochs_carried(self) -> None:
        """Beside a carried draft (qwen_scaling) or from a carried checkpoint (train_in_session),
        the drafts train at its epochs: the scaling drafts so that the curve's points share the
        draft's recipe, the resumed draft because the trainer refuses a resume on another. A
        checkpoint's are exact (its trainer state's total steps over its steps an epoch); a
        draft's, its total steps (run/train/result.json's recipe) over the steps an epoch of the
        run's regenerated tokens makes (PACKING_SLACK: 612 steps of 3 epochs read as 2.9).
        measurements.json's train_epochs says so; epochs given with --set stand, and a restart
        keeps the first reading; a schedule in steps (a rehearsal's max_steps) is its own."""
        train = self.params_data()["train"]
        if ("train", "epochs") in self.settings or train.get("max_steps"):
            return
        chosen = self.measure.get("train_epochs")
        if chosen is None:
            checkpoint = travel.newest_checkpoint(self.run_root) if travel.carried()["checkpoint"] else None
            if checkpoint is not None:
                state = read_json(checkpoint / "trainer_state.json") or {}
                total, per_epoch = state.get("total_steps"), state.get("steps_per_epoch")
                source = {"carried_checkpoint": checkpoint.name, "carried_checkpoint_steps": total}
            else:
                total = ((read_json(self.run_root / "train/result.json") or {}).get("recipe") or {}).get("total_steps")
                progress = read_json(self.run_root / "generate/progress.json")
                per_epoch = steps_per_epoch(progress, train) if progress else None
                source = {"carried_draft_steps": total}
            if not total or not per_epoch:
                return
            chosen = {"epochs": max(1, round(total / per_epoch)), "profile_epochs": int(train["epochs"]),
                      **source, "steps_per_epoch_estimate": per_epoch}  # fmt: skip
            self.save_measure("train_epochs", chosen)
        self._train_at(chosen)
