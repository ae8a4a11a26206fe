"""Train the EAGLE-3 draft on the target's hidden states (the `train` stage's work): read from
the extract stage's shards (`train.hidden_states: offline`), or captured from the target batch by
batch as it trains (`online`, tasks/draft/online.py; nothing stored).

`Trainer.train` reads top to bottom: set up the data (tasks/draft/train_setup.py: the draft's
shape, the data index, the vocabulary map, the plan), build the model and optimizer (the recipe's
choices: tasks/draft/recipe.py), resume from the newest complete checkpoint (every refusal in
tasks/draft/resume.py), evaluate the untrained draft (tasks/draft/evaluation.py), then loop: one
training-time-test step per batch, evaluate on the held-out split, checkpoint, keep the best, and
stop at a checkpoint past which train.time_budget_s does not reach (tasks/draft/time_budget.py).
Runs as one process or under torchrun (DDP; gloo on CPU, nccl on GPU); only rank 0 writes.

Every step records its gradient norm before clipping and whether it was clipped; train/result.json
keeps the steps and the evaluations, the plot draws both.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from tasks.config import TrainConfig
from tasks.draft import checkpoint as ckpt
from tasks.draft import objectives
from tasks.draft.architecture import DraftConfig
from tasks.draft.data import (
    SequenceReader,
    iter_batches,
    plan_epoch,
    rank_batches,
    write_data_metadata,
)
from tasks.draft.distributed import Dist
from tasks.draft.evaluation import (
    HeldOut,
    check_target_agreement,
    evaluate,
    greedy_replies,
    training_window,
    wilson_upper,
)
from tasks.draft.model import Eagle3Draft
from tasks.draft.online import OnlineTarget
from tasks.draft.plots import accuracy_plot_png
from tasks.draft.recipe import loss_denominator, recipe_record, start_from_target, with_aux_noise
from tasks.draft.resume import check_split, resume_checkpoint
from tasks.draft.starting_draft import StartingDraft
from tasks.draft.target_heads import load_target_heads, load_target_norm
from tasks.draft.time_budget import TimeBudget
from tasks.draft.train_setup import (
    TrainData,
    TrainError,
    draft_config_for,
    open_states,
    plan_data,
    starting_draft,
    vocab_and_index,
)
from tasks.draft.ttt import Batch, StepStats, TTTModel, counted_rows, summarize
from tasks.draft.vocab import VocabMap
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_BEST, TRAIN_PLOT, TRAIN_RESULT

# The trainer's public names, with those its parts' modules now hold that callers import from here.
__all__ = ["Dist", "TrainCallbacks", "TrainError", "TrainOptions", "TrainResult", "Trainer", "build_optimizer",
           "check_target_agreement", "lr_multiplier", "train_draft", "train_step", "vocab_and_index",
           "wilson_upper"]  # fmt: skip

log = logging.getLogger(__name__)


@dataclass
class TrainCallbacks:
    on_step: Callable[[dict[str, Any]], None] | None = None  # every optimizer step (rank 0)
    on_eval: Callable[[dict[str, Any]], None] | None = None  # every evaluation (rank 0)
    on_checkpoint: Callable[[str], None] | None = None  # run key of each saved checkpoint
    # Once, before the first step: the data indexed, the model built, the untrained evaluation
    # made (an online run's target loaded for it). What comes after is the steps' own time.
    on_ready: Callable[[], None] | None = None


@dataclass
class TrainResult:
    steps: int
    history: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    best: dict[str, Any] | None
    last_checkpoint: str | None
    resumed_from: str | None
    vocab_stats: dict[str, Any] = field(default_factory=dict)
    # Stopped at last_checkpoint before the last step: train.time_budget_s would not reach the
    # next one. A later run resumes it; nothing is exported meanwhile.
    stopped_for_budget: bool = False


@dataclass(frozen=True)
class TrainOptions:
    """What a caller chooses beside the recipe (TrainConfig), for one draft's training."""

    vocab_map: VocabMap | None = None  # instead of the one counted on the training split (saved with the run)
    callbacks: TrainCallbacks | None = None
    keep_checkpoints: int = 2  # the newest complete ones kept, besides the best
    eval_max_batches: int | None = None  # a cap on the held-out batches (kept up to cfg.eval_cache_gib)
    max_train_sequences: int | None = None  # the first N training sequences only; default cfg's
    # Only these training sequences (generation request ids), e.g. those of synthesized prompts
    # alone (benchmarks/synthetic_transfer.py); None: all. Applied before max_train_sequences.
    train_subset: frozenset[str] | None = None
    compile_kernels: bool | None = None  # torch.compile the layer's elementwise work; default: on CUDA
    online: OnlineTarget | None = None  # OnlineTarget.from_config: required for hidden_states online
    # The held-out split this draft must share (the digest another record holds, None from before
    # the key, and where that record is): a scaling draft's full draft's. Refused before any step.
    split_of: tuple[str | None, str] | None = None
    # train.time_budget_s as a deadline several drafts share (the train stage's); default: this
    # draft's cfg.time_budget_s from its start.
    budget: TimeBudget | None = None
    # Rank 0, once the draft has reached its last step (never after a stop for the time budget),
    # before the other ranks go on: what ships it (a scaling draft's export).
    export: Callable[[TrainResult], None] | None = None


# Per-step fields train/result.json keeps (checkpoints keep every field of every step).
HISTORY_COLUMNS = ("step", "lr", "loss", "grad_norm", "clipped", "batch_tokens", "tok_per_s", "data_wait_s",
                   "sim_accept_len")  # fmt: skip


def lr_multiplier(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1, then cosine to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(
    params: list[torch.Tensor], cfg: TrainConfig, total_steps: int, device: torch.device
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the fp32 master weights (fused on CUDA) and the warm-up + cosine schedule."""
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=tuple(cfg.adam_betas),
        fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, total_steps)
    )
    return optimizer, scheduler


def train_step(
    stepper: torch.nn.Module,
    batch: Batch,
    cfg: TrainConfig,
    device: torch.device,
    compute_dtype: torch.dtype,
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int = 0,
    rank: int = 0,
) -> tuple[StepStats, torch.Tensor]:
    """One optimizer step on a batch (on the host, or its states on the device already): unroll,
    backward, clip, AdamW, schedule; `step` (the optimizer steps before this one) and `rank` seed
    the aux-state noise.
    (benchmarks/p4_train_step.py times exactly this.) Returns the gradient norm before clipping."""
    rows = counted_rows(batch.loss_mask, cfg.ttt_steps, device)
    autocast = torch.autocast(device.type, dtype=compute_dtype,
                              enabled=compute_dtype != torch.float32)
    on_device = with_aux_noise(batch.to(device, compute_dtype), cfg.aux_state_noise, cfg.seed, step, rank)
    with autocast:
        loss, stats = stepper(on_device, rows, cfg.ttt_steps, cfg.ttt_decay, cfg.logits_chunk,
                              loss_denominator=loss_denominator(cfg))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, foreach=True)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return stats, grad_norm


class Trainer:
    """One draft's training on `run`: `train()` once (or resumed, by a later Trainer)."""

    # Set up by train(), in its order.
    data: TrainData
    held_out: HeldOut
    draft_cfg: DraftConfig
    start: StartingDraft | None  # train.init_from
    draft: Eagle3Draft
    model: TTTModel
    stepper: torch.nn.Module  # the model, in DDP under torchrun
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    recipe: dict[str, Any]  # what a checkpoint records of the recipe (recipe_record)
    state: dict[str, Any]  # the trainer state a checkpoint keeps: step, history, evals, best, ...
    resumed_from: str | None
    last_saved: str | None

    def __init__(self, run: RunFolder, cfg: TrainConfig, target_model_path: str,
                 options: TrainOptions | None = None) -> None:  # fmt: skip
        self.run, self.cfg, self.target_model_path = run, cfg, target_model_path
        try:  # before any data is read: an unknown objective is a config error
            objectives.objective(cfg.objective)
        except ValueError as e:
            raise TrainError(str(e)) from None
        self.options = options or TrainOptions()
        self.callbacks = self.options.callbacks or TrainCallbacks()
        self.budget = self.options.budget or TimeBudget(cfg.time_budget_s)
        self.rank = Dist.current()
        self.device = self.rank.device(cfg.device)
        self.compute_dtype = torch.bfloat16 if cfg.compute_dtype == "bfloat16" else torch.float32
        self.step = 0
        self.stopped_for_budget = False

    def record_data(self) -> None:
        """The set-up alone: the vocabulary map counted on the training split and the data's
        record (train/data.json), what the scaling drafts share with this draft, before any of
        them trains (train.forecast_full_draft)."""
        self.data = self._set_up_data()
        if self.rank.rank == 0:
            write_data_metadata(self.run, self.cfg.hidden_states, self.data.meta, self.data.index)
        self.data.close()

    def train(self) -> TrainResult:
        """Train (or resume training) the draft; returns the metric history."""
        self.data = self._set_up_data()
        self.held_out = HeldOut(self.data.eval_batches, self._reader, self.compute_dtype,
                                pin=self.device.type == "cuda", cache_gib=self.cfg.eval_cache_gib)  # fmt: skip
        self._build_model()
        self._resume()
        self._evaluate_before_training()
        self._loop()
        self.data.close()
        result = self._finish()
        self._export(result)
        return result

    # -- set-up: the data, then the model -----------------------------------------------------

    def _set_up_data(self) -> TrainData:
        """The draft's shape, the starting draft, the vocabulary and data index, the plan; every
        refusal about them comes before any weight exists."""
        cfg, options = self.cfg, self.options
        source, meta = open_states(self.run, cfg, options.online, self.device)
        self.draft_cfg = draft_config_for(cfg, self.target_model_path, meta)
        self.start, vocab_map = starting_draft(cfg, self.draft_cfg, options.vocab_map)
        if self.rank.rank == 0:
            ckpt.remove_incomplete(self.run)
        limit = cfg.max_train_sequences if options.max_train_sequences is None else options.max_train_sequences
        vocab, index = vocab_and_index(self.run, self.draft_cfg.vocab_size, self.draft_cfg.draft_vocab_size,
                                       self.rank, vocab_map, source.index if source else None, limit,
                                       options.train_subset)  # fmt: skip
        index = index.subset("train", options.train_subset).limited("train", limit)
        steps_per_epoch, total_steps, eval_batches = plan_data(self.run, cfg, self.draft_cfg, vocab, index,
                                                               self.rank, options.eval_max_batches)  # fmt: skip
        return TrainData(self.run, source, meta, index, vocab, steps_per_epoch, total_steps, eval_batches)

    def _reader(self) -> SequenceReader:
        return self.data.reader(self.compute_dtype)

    def _build_model(self) -> None:
        """The draft, its training-time-test model, the optimizer and schedule. The same seed on
        every rank: identical initial weights."""
        cfg, device, vocab = self.cfg, self.device, self.data.vocab
        torch.manual_seed(cfg.seed)
        embed, lm_head = load_target_heads(self.target_model_path)
        head_dtype = self.compute_dtype if device.type == "cuda" else torch.float32
        self.draft = Eagle3Draft(self.draft_cfg, embed.to(head_dtype))
        self.draft.set_vocab(vocab.d2t, vocab.t2d)
        target_norm = load_target_norm(self.target_model_path) if cfg.init_norm_from_target else None
        start_from_target(self.draft, lm_head, vocab.draft_ids, target_norm, cfg)
        if self.start is not None:  # a resume then loads its checkpoint over these
            self.draft.load_exportable_state_dict(self.start.weights)
        compile_kernels = self.options.compile_kernels
        if compile_kernels is None:
            compile_kernels = device.type == "cuda"
        self.model = TTTModel(self.draft, lm_head.to(head_dtype), vocab.draft_ids, compile_kernels,
                              self.cfg.objective).to(device)  # fmt: skip
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.params, cfg, self.data.total_steps, device)
        self.stepper = DistributedDataParallel(self.model, broadcast_buffers=False) if self.rank.world > 1 else self.model

    # -- resume ----------------------------------------------------------------------------------

    def _resume(self) -> None:
        """From the newest complete checkpoint, when there is one and this run is its
        continuation (tasks/draft/resume.py refuses any other); else from step 0."""
        if self.options.split_of is not None:
            check_split(self.data, *self.options.split_of)
        self.state = {"step": 0, "history": [], "evals": [], "best": None}
        self.resumed_from = ckpt.latest_checkpoint(self.run)
        self.recipe = recipe_record(self.cfg, self.data.total_steps, self.start.sha256 if self.start else None)
        if self.resumed_from is not None:
            self.state = resume_checkpoint(self.run, self.resumed_from, self.cfg, self.data, self.recipe,
                                           self.draft, self.optimizer, self.scheduler)  # fmt: skip
        if self.rank.rank == 0:  # what export, the gate and the scaling drafts read (after the mode check)
            write_data_metadata(self.run, self.cfg.hidden_states, self.data.meta, self.data.index)
        self.step = self.state["step"]
        self.last_saved = self.resumed_from

    def _evaluate_before_training(self) -> None:
        """The untrained draft's evaluation (and its check of the replies); a resumed draft's
        held-out batches read instead."""
        if self.step == 0 and self.held_out:
            self._record_eval()  # the untrained baseline
            # Before the first step: are the replies the target's own? (a server of other weights)
            check_target_agreement(self.state["evals"][-1], self.cfg.min_target_agreement,
                                   greedy_replies(self.run), self.run.url)  # fmt: skip
        elif self.held_out and self.step < self.data.total_steps:
            # A resumed draft reads (online: captures) its held-out batches now, as a fresh one does in
            # its untrained evaluation, so that its first evaluation costs what every later one does
            # and the set-up before its first step says what it takes (a first evaluation after a
            # resume once took 58.6 s with its save, the capture of 793 sequences included, against
            # 9.7 s: BENCHMARKS P27), and the pace the time budget measures is the steps' own.
            self.held_out.read()

    # -- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        """Step through the epochs' batches to the last step, evaluating and checkpointing on the
        way, or to the checkpoint past which the time budget does not reach."""
        reader = self._reader()
        self.model.train()
        if self.rank.rank == 0 and self.callbacks.on_ready:
            self.callbacks.on_ready()
        self.budget.pace_from(self.step)
        while self.step < self.data.total_steps:
            with closing(self._epoch_batches(reader)) as batches:
                for batch, data_wait in batches:
                    self._train_step(batch, data_wait)
                    if self._after_step():
                        return

    def _epoch_batches(self, reader: SequenceReader) -> Iterator[tuple[Batch, float]]:
        """This rank's batches of the current epoch from the current step on, each with how long
        the step waited for it (read, captured online, padded, pinned by the worker thread): ~0
        while that thread keeps ahead of the GPU, the step's share otherwise."""
        epoch, start = divmod(self.step, self.data.steps_per_epoch)
        plan = plan_epoch(self.data.index, "train", epoch, self.cfg.seed, self.cfg.batch_tokens)
        batches = rank_batches(plan, self.rank.rank, self.rank.world)
        asked = time.perf_counter()
        for batch in iter_batches(reader, batches, start, pin=self.device.type == "cuda"):
            yield batch, time.perf_counter() - asked
            asked = time.perf_counter()

    def _train_step(self, batch: Batch, data_wait: float) -> None:
        """One optimizer step, its figures summed over the ranks and recorded."""
        began = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        stats, grad_norm = train_step(self.stepper, batch, self.cfg, self.device, self.compute_dtype, self.params,
                                      self.optimizer, self.scheduler, self.step, self.rank.rank)  # fmt: skip
        self.step += 1
        for t in (stats.loss_sum, stats.correct, stats.count):
            self.rank.sum_(t)
        tokens = self.rank.sum_(torch.tensor(float(batch.tokens), device=self.device)).item()
        elapsed = time.perf_counter() - began
        # Training accuracies use the teacher's argmax within the draft vocabulary (no
        # full-vocabulary matmul per step); evaluations use the full vocabulary.
        # The norm before clipping (clip_grad_norm_'s return), of this rank's gradient after
        # DDP's all-reduce: the same on every rank.
        record = {"step": self.step, "lr": lr, "grad_norm": float(grad_norm),
                  "clipped": float(grad_norm) > self.cfg.max_grad_norm, "batch_tokens": tokens,
                  "tok_per_s": tokens / elapsed, "data_wait_s": data_wait, "acc_basis": "draft_vocab",
                  **summarize(stats, self.cfg.ttt_decay)}  # fmt: skip
        self.state["history"].append(record)
        if self.rank.rank == 0 and self.callbacks.on_step:
            self.callbacks.on_step(record)

    def _after_step(self) -> bool:
        """Evaluate and checkpoint where the schedule says (and wherever the held-out figures
        improve); True where the loop ends: the last step, or a checkpoint the budget stops at."""
        cfg, final = self.cfg, self.step == self.data.total_steps
        better = self._record_eval() if self.held_out and (self.step % cfg.eval_every == 0 or final) else False
        if self.step % cfg.save_every == 0 or better or final:
            self._save_checkpoint(better)
            if not final and self._out_of_time():
                self.stopped_for_budget = True
                return True
        return final

    # -- evaluation, checkpoint, time budget -----------------------------------------------------

    def _record_eval(self) -> bool:
        """Evaluate now and record it; True when it is the best so far (a trained step's)."""
        result = {**evaluate(self.model, self.held_out, self.cfg, self.device, self.rank, self.step),
                  **training_window(self.state, self.step, self.cfg.max_grad_norm)}  # fmt: skip
        if self.device.type == "cuda":  # what sizing batch_tokens (or sharing the GPU) needs to know
            result.update(cuda_peak_allocated_gib=torch.cuda.max_memory_allocated(self.device) / 2**30,
                          cuda_peak_reserved_gib=torch.cuda.max_memory_reserved(self.device) / 2**30)  # fmt: skip
        state = self.state
        state["evals"].append(result)
        better = self.step > 0 and (state["best"] is None or result["sim_accept"] > state["best"]["sim_accept"])
        if better:
            state["best"] = {"step": self.step, "sim_accept": result["sim_accept"],
                             "sim_accept_len": result["sim_accept_len"]}  # fmt: skip
        if self.rank.rank == 0:
            self.run.write_bytes_atomic(TRAIN_PLOT, accuracy_plot_png(state["evals"], state["history"],
                                                                      self.cfg.max_grad_norm))  # fmt: skip
            if self.callbacks.on_eval:
                self.callbacks.on_eval(result)
        return better

    def _save_checkpoint(self, best_changed: bool) -> None:
        """Checkpoint the step (rank 0 writes, every rank waits), point train/best.json at it when
        it is the best, and prune all but the newest and the best."""
        self.last_saved = ckpt.checkpoint_key(self.step)
        if self.rank.rank == 0:
            per_epoch, best = self.data.steps_per_epoch, self.state["best"]
            trainer_state = {**self.state, "hidden_states": self.cfg.hidden_states,
                             "train_sequences": self.data.train_sequences, "holdout": self.data.meta.get("holdout"),
                             "recipe": self.recipe, "step": self.step, "epoch": self.step // per_epoch,
                             "batch_in_epoch": self.step % per_epoch, "steps_per_epoch": per_epoch,
                             "total_steps": self.data.total_steps}  # fmt: skip
            ckpt.save_checkpoint(self.run, self.step, self.draft, self.optimizer, self.scheduler, trainer_state)
            if best_changed:
                self.run.write_json_atomic(TRAIN_BEST, {**best, "checkpoint": self.last_saved})
            protect = {ckpt.checkpoint_key(best["step"])} if best else set()
            ckpt.prune_checkpoints(self.run, self.options.keep_checkpoints, protect)
            if self.callbacks.on_checkpoint:
                self.callbacks.on_checkpoint(self.last_saved)
        self.rank.barrier()

    def _out_of_time(self) -> bool:
        """Whether the next scheduled checkpoint would come past the time budget at the pace so
        far; any rank's clock saying so stops every rank."""
        if self.budget.seconds is None:
            return False
        every = self.cfg.save_every
        next_step = min((self.step // every + 1) * every, self.data.total_steps)
        late = not self.budget.next_checkpoint_fits(self.step, next_step)
        return self.rank.sum_(torch.tensor(float(late), device=self.device)).item() > 0

    # -- the end: the result, and the export hook --------------------------------------------------

    def _finish(self) -> TrainResult:
        state, vocab = self.state, self.data.vocab
        result = TrainResult(self.step, state["history"], state["evals"], state["best"], self.last_saved,
                             self.resumed_from, vocab.stats, self.stopped_for_budget)  # fmt: skip
        if self.stopped_for_budget:
            log.info("train: stopped for train.time_budget_s (%s s) at step %d of %d; %s/%s resumes it",
                     self.budget.seconds, self.step, self.data.total_steps, self.run.url, self.last_saved)
        if self.rank.rank == 0:
            history = [{k: h[k] for k in HISTORY_COLUMNS if k in h} for h in state["history"]]
            self.run.write_json_atomic(TRAIN_RESULT, {
                "steps": self.step, "best": state["best"], "last_checkpoint": self.last_saved,
                "resumed_from": self.resumed_from, "recipe": self.recipe, "evals": state["evals"],
                "history": history, "vocab": vocab.stats, "stopped_for_budget": self.stopped_for_budget})  # fmt: skip
        return result

    def _export(self, result: TrainResult) -> None:
        """The caller's export hook, on a draft that reached its last step: rank 0 ships it while
        the others wait."""
        if self.options.export is None or result.stopped_for_budget:
            return
        if self.rank.rank == 0:
            self.options.export(result)
        self.rank.barrier()


def train_draft(run: RunFolder, cfg: TrainConfig, target_model_path: str, options: TrainOptions | None = None,
                **chosen: Any) -> TrainResult:  # fmt: skip
    """Train (or resume training) the draft of `run`; returns the metric history. `chosen`:
    TrainOptions' fields by name, over `options` (train_draft(run, cfg, path, online=...))."""
    options = dataclasses.replace(options or TrainOptions(), **chosen)
    return Trainer(run, cfg, target_model_path, options).train()
