"""Train the EAGLE-3 draft on the target's hidden states (the `train` stage's work): read from
the extract stage's shards (`train.hidden_states: offline`), or captured from the target batch by
batch as it trains (`online`, tasks/draft/online.py; nothing stored).

Read top to bottom: set up (target heads, draft shape, data index, vocab map), build the
model and optimizer (the recipe's choices: tasks/draft/recipe.py), resume from the newest
complete checkpoint, then loop: one training-time-test step per batch, evaluate on the
held-out split, checkpoint, keep the best. Runs as one process or under torchrun (DDP; gloo on
CPU, nccl on GPU); only rank 0 writes.

Curves: every step records its gradient norm before clipping and whether it was clipped;
every evaluation records the held-out metrics, and the mean and largest gradient norm and the
fraction of steps clipped since the previous evaluation (`train_grad_norm`,
`train_grad_norm_max`, `train_clip_rate`); train/result.json keeps both, the plot draws both.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tasks.config import TrainConfig
from tasks.draft import checkpoint as ckpt
from tasks.draft.acceptance import chain_totals, pooled_accept_length
from tasks.draft.architecture import DraftConfig
from tasks.draft.data import (
    DataIndex,
    SequenceReader,
    ShardReader,
    build_index,
    iter_batches,
    plan_epoch,
    rank_batches,
    write_data_metadata,
)
from tasks.draft.model import Eagle3Draft
from tasks.draft.online import OnlineData, OnlineTarget
from tasks.draft.plots import accuracy_plot_png
from tasks.draft.recipe import (
    loss_denominator,
    recipe_differences,
    recipe_record,
    start_from_target,
    with_aux_noise,
)
from tasks.draft.starting_draft import read_starting_draft
from tasks.draft.target_heads import load_target_heads, load_target_norm
from tasks.draft.ttt import (
    Batch,
    StepStats,
    TTTModel,
    agreement_counts,
    counted_rows,
    stored_token_matches,
    summarize,
)
from tasks.draft.vocab import VocabMap, build_vocab_map, count_tokens
from tasks.extract.sequences import holdout_changed
from tasks.runfolder import RunFolder
from tasks.runfolder.fingerprint import RUN_JSON
from tasks.runfolder.layout import TRAIN_BEST, TRAIN_PLOT, TRAIN_RESULT, TRAIN_VOCAB_MAP
from tasks.target.model_dir import read_model_config, resolve_model_dir


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


def greedy_replies(run: RunFolder) -> bool:
    """Whether the run's replies were sampled at temperature 0 (its run.json): only then must they
    be the target's argmax wherever it predicts them. False without a run.json (data made by hand)."""
    sampling = ((run.read_json(RUN_JSON) or {}).get("fingerprint") or {}).get("sampling") or {}
    return sampling.get("temperature") == 0


AGREEMENT_Z = 3.29  # two-sided 99.9%: a run is stopped on its data only when the figure leaves no doubt


def wilson_upper(p: float, n: int, z: float) -> float:
    """The Wilson score interval's upper end for a share `p` of `n` trials."""
    if n <= 0:
        return 1.0
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def check_target_agreement(evaluation: dict[str, Any], threshold: float | None, greedy: bool, where: str) -> None:
    """TrainError when greedy replies are too seldom the target's own argmax (the untrained
    evaluation's target_agreement): the servers that wrote them served other weights, which a
    shared vocabulary hides from generation's checks, and a draft trained on them would learn
    another model's choices. Nothing to check at a sampled temperature or with no held-out tokens."""
    agreement, tokens = evaluation.get("target_agreement"), evaluation.get("target_agreement_tokens") or 0
    if threshold is None or not greedy or agreement is None:
        return
    # Refused only when it is below beyond its sampling noise: a few dozen held-out tokens (a
    # tiny run) say little, and a random tiny target in bf16 flips its near-ties.
    upper = wilson_upper(agreement, tokens, AGREEMENT_Z)
    if upper >= threshold:
        return
    raise TrainError(
        f"{where}: the replies are not the target's greedy output: {agreement:.1%} of the "
        f"{tokens:,} response tokens of the held-out sequences are the target's argmax where it "
        f"predicts them (at most {upper:.1%} within sampling noise), below train.min_target_agreement ({threshold:.0%}); "
        "the target's own greedy replies agree at ~99%. The generation servers served another model or "
        "other weights than target.model_path (each row of generate/data names its server). Fix: "
        "regenerate with servers launched with the target, or point target.model_path at the weights "
        "the servers ran; for replies from another model on purpose, set train.min_target_agreement: null"
    )


# Per-step fields train/result.json keeps (checkpoints keep every field of every step).
HISTORY_COLUMNS = ("step", "lr", "loss", "grad_norm", "clipped", "batch_tokens", "tok_per_s", "data_wait_s",
                   "sim_accept_len")  # fmt: skip


class TrainError(RuntimeError):
    """Training cannot start: the extracted data does not fit the target or the config."""


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def current(cls) -> Dist:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
        return cls()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor


def lr_multiplier(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1, then cosine to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _draft_config(cfg: TrainConfig, target_path: str, extract_meta: dict[str, Any]) -> DraftConfig:
    target_config = read_model_config(resolve_model_dir(target_path))
    draft_cfg = DraftConfig.from_target(target_config, cfg.draft_vocab_size, cfg.intermediate_size)
    stored_ids = [int(i) for i in extract_meta.get("aux_layer_ids", [])]
    if stored_ids != draft_cfg.aux_layer_ids:
        raise TrainError(
            f"extracted aux layers {stored_ids} differ from the draft's "
            f"{draft_cfg.aux_layer_ids} for this target: re-extract or check the target path"
        )
    if int(extract_meta.get("hidden_size", -1)) != draft_cfg.target_hidden_size:
        raise TrainError(
            f"extracted hidden_size {extract_meta.get('hidden_size')} differs from the "
            f"target's {draft_cfg.target_hidden_size}"
        )
    return draft_cfg


def vocab_and_index(
    run: RunFolder, vocab_size: int, draft_vocab_size: int, rank: Dist, vocab_map: VocabMap | None = None,
    indexer: Callable[..., DataIndex] | None = None, max_train_sequences: int | None = None,
) -> tuple[VocabMap, Any]:
    """The draft vocabulary map and the data index. Rank 0 indexes the data and, when neither
    `vocab_map` nor a saved map exists, counts the training split's loss-masked tokens in the
    same pass (eval sequences never count; past `max_train_sequences`, neither do the rest: the
    indexing visits them in index order, the order DataIndex.limited keeps) and saves the map;
    the other ranks load both. `indexer(visit, use_cache=...)` indexes the data (default: the
    extract shards')."""
    build = indexer or (lambda visit=None, use_cache=True: build_index(run, visit, use_cache))
    if rank.rank == 0:
        have_map = vocab_map is not None or run.exists(TRAIN_VOCAB_MAP)
        counted: list[tuple[torch.Tensor, torch.Tensor]] = []

        def visit(seq: Any) -> None:
            if seq.split == "train" and (max_train_sequences is None or len(counted) < max_train_sequences):
                counted.append((seq.input_ids, seq.loss_mask))

        index = build(None if have_map else visit, use_cache=have_map)
        if vocab_map is None and not have_map:
            counts = count_tokens(counted, vocab_size)
            build_vocab_map(counts, draft_vocab_size).save(run)
        elif vocab_map is not None:
            vocab_map.save(run)
    rank.barrier()
    if rank.rank != 0:
        index = build()
    return VocabMap.load(run), index


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


def train_draft(
    run: RunFolder,
    cfg: TrainConfig,
    target_model_path: str,
    *,
    vocab_map: VocabMap | None = None,
    callbacks: TrainCallbacks | None = None,
    keep_checkpoints: int = 2,
    eval_max_batches: int | None = None,
    max_train_sequences: int | None = None,
    compile_kernels: bool | None = None,
    online: OnlineTarget | None = None,
    split_of: tuple[str | None, str] | None = None,
) -> TrainResult:
    """Train (or resume training) the draft of `run`; returns the metric history.

    `vocab_map` overrides the one built from the training split (saved with the run);
    `eval_max_batches` caps the held-out set (kept in host memory up to cfg.eval_cache_gib);
    `max_train_sequences` trains on the first N training sequences only (data scaling; default
    cfg.max_train_sequences);
    `compile_kernels` fuses the layer's elementwise work with torch.compile (default: on CUDA);
    `online` (OnlineTarget.from_config) is required when cfg.hidden_states is "online";
    `split_of` (the held-out split's digest some other record holds, None from before the key,
    and where that record is) is the split this draft must share (a scaling draft: its full
    draft's), refused before any step when it would make another.
    """
    from tasks.extract.storage import extract_metadata

    callbacks = callbacks or TrainCallbacks()
    rank = Dist.current()
    device = torch.device(cfg.device)
    if device.type == "cuda" and rank.world > 1:
        device = torch.device("cuda", rank.local_rank)
    compute_dtype = torch.bfloat16 if cfg.compute_dtype == "bfloat16" else torch.float32
    autocast = torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32)

    # -- set-up: the draft's shape, the data, the vocabulary -------------------------------
    source: OnlineData | None = None
    if cfg.hidden_states == "online":
        if online is None:
            raise TrainError("train.hidden_states is 'online' but no OnlineTarget was given: pass "
                             "online=OnlineTarget.from_config(config) (the target and extract settings)")
        source = OnlineData(run, online, device)
        data_meta = source.metadata()
    else:
        data_meta = extract_metadata(run)
    draft_cfg = _draft_config(cfg, target_model_path, data_meta)
    # train.init_from: read and checked before the data is indexed; its vocabulary map is the run's.
    start = read_starting_draft(cfg.init_from, draft_cfg) if cfg.init_from else None
    if start is not None:
        if vocab_map is not None and not torch.equal(vocab_map.d2t, start.vocab.d2t):
            raise TrainError(f"train.init_from {start.source}: its vocabulary map is not the one this draft "
                             "was given (a scaling draft trains on its full draft's)")
        vocab_map = start.vocab
    if rank.rank == 0:
        ckpt.remove_incomplete(run)
    if max_train_sequences is None:
        max_train_sequences = cfg.max_train_sequences
    vocab, index = vocab_and_index(run, draft_cfg.vocab_size, draft_cfg.draft_vocab_size, rank, vocab_map,
                                   source.index if source else None, max_train_sequences)

    def make_reader() -> SequenceReader:
        # Online, the captured states stay on the device in compute_dtype (OnlineReader).
        return source.reader(index, compute_dtype) if source else ShardReader(run, index)

    index = index.limited("train", max_train_sequences)
    if vocab.draft_vocab_size != draft_cfg.draft_vocab_size or vocab.vocab_size != draft_cfg.vocab_size:
        raise TrainError(
            f"{run.url}/{TRAIN_VOCAB_MAP}: vocab map of {vocab.draft_vocab_size}/{vocab.vocab_size} "
            f"tokens does not fit draft_vocab_size {draft_cfg.draft_vocab_size} / target vocab "
            f"{draft_cfg.vocab_size}"
        )
    train_plan_len = len(plan_epoch(index, "train", 0, cfg.seed, cfg.batch_tokens))
    steps_per_epoch = train_plan_len // rank.world
    if steps_per_epoch == 0:
        raise TrainError(
            f"{run.url}: {train_plan_len} training batches for {rank.world} processes; "
            "need at least one each (more data or a smaller batch_tokens)"
        )
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    eval_batches = rank_batches(
        plan_epoch(index, "eval", 0, cfg.seed, cfg.batch_tokens, shuffle=False),
        rank.rank, rank.world, even=False,
    )[:eval_max_batches]

    # -- model, optimizer, schedule (same seed on every rank: identical initial weights) -----
    torch.manual_seed(cfg.seed)
    embed, lm_head = load_target_heads(target_model_path)
    head_dtype = compute_dtype if device.type == "cuda" else torch.float32
    draft = Eagle3Draft(draft_cfg, embed.to(head_dtype))
    draft.set_vocab(vocab.d2t, vocab.t2d)
    start_from_target(draft, lm_head, vocab.draft_ids,
                      load_target_norm(target_model_path) if cfg.init_norm_from_target else None, cfg)
    if start is not None:  # a resume then loads its checkpoint over these
        draft.load_exportable_state_dict(start.weights)
    if compile_kernels is None:
        compile_kernels = device.type == "cuda"
    model = TTTModel(draft, lm_head.to(head_dtype), vocab.draft_ids, compile_kernels).to(device)
    del embed, lm_head
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(params, cfg, total_steps, device)
    stepper = DistributedDataParallel(model, broadcast_buffers=False) if rank.world > 1 else model

    def check_split(recorded: str | None, where: str) -> None:
        """Refuse a held-out split other than the one `where` recorded (holdout_changed)."""
        if source is not None:  # online: the split is made here, from the manifest
            changed = holdout_changed(recorded, source.builder, where)
        elif None not in (recorded, data_meta.get("holdout")) and recorded != data_meta["holdout"]:
            changed = f"{where} was made with the held-out split {recorded}, the extracted shards hold {data_meta['holdout']}"
        else:
            changed = None
        if changed:
            raise TrainError(changed)

    if split_of is not None:
        check_split(*split_of)

    # -- resume --------------------------------------------------------------------------
    state: dict[str, Any] = {"step": 0, "history": [], "evals": [], "best": None}
    resumed_from = ckpt.latest_checkpoint(run)
    recipe = recipe_record(cfg, total_steps, start.sha256 if start else None)
    if resumed_from is not None:
        # Checked before the weights and optimizer load: a frozen head, say, changes the
        # optimizer's parameter groups, and loading would fail without naming why.
        state = ckpt.read_trainer_state(run, resumed_from)
        recorded_mode = state.get("hidden_states", "offline")  # checkpoints before the key: offline
        if recorded_mode != cfg.hidden_states:
            raise TrainError(
                f"{run.url}/{resumed_from}: trained with train.hidden_states {recorded_mode!r}, "
                f"this run asks for {cfg.hidden_states!r}; resume in {recorded_mode!r} mode, or "
                "remove train/checkpoints to start over"
            )
        # A split changed since (extract.holdout_unit, say) would train on what the checkpoint held out.
        check_split(state.get("holdout"), f"{run.url}/{resumed_from}")  # checkpoints before the key: per prompt
        recorded_n = state.get("train_sequences")  # checkpoints before the key: not checked
        if recorded_n is not None and recorded_n != len(index.split("train")):
            raise TrainError(
                f"{run.url}/{resumed_from}: trained on {recorded_n} training sequences, this run has "
                f"{len(index.split('train'))} (train.max_train_sequences or the data changed); resume "
                "with the same data, or remove train/checkpoints to start over"
            )
        differences = recipe_differences(state.get("recipe"), recipe)
        if differences:
            raise TrainError(
                f"{run.url}/{resumed_from}: trained with another recipe: " + "; ".join(differences)
                + "; resume with the checkpoint's settings, or remove train/checkpoints to start over"
            )
        state = ckpt.load_training_state(run, resumed_from, draft, optimizer, scheduler)
        if not torch.equal(draft.d2t.cpu(), vocab.d2t):
            raise TrainError(f"{run.url}/{resumed_from}: trained with another vocab map than "
                             f"{TRAIN_VOCAB_MAP}; remove one of them")
    if rank.rank == 0:  # what export, the gate and the scaling drafts read (after the mode check)
        write_data_metadata(run, cfg.hidden_states, data_meta, index)
    step = state["step"]
    last_saved = resumed_from

    # The held-out batches, read once (online: captured once) and kept on the host between
    # evaluations, in compute_dtype (what each evaluation casts them to anyway: the same values at
    # half float32's bytes) and page-locked on a GPU, so that an evaluation only copies them. Kept
    # in float32 and pinned anew by every evaluation, run 21's 793 held-out sequences were 15 GiB
    # (~12 s an evaluation with its save, against ~6 s for run 15's 205). Past eval_cache_gib none
    # are kept and each evaluation reads them again: the held-out split grows with the data.
    eval_cache: list[Batch] | None = None  # None until an evaluation has read them all within the budget
    eval_batches_kept = True  # False once past eval_cache_gib: every evaluation reads them again

    def eval_source() -> Iterator[Batch]:
        nonlocal eval_cache, eval_batches_kept
        if eval_cache is not None:
            yield from eval_cache
            return
        kept: list[Batch] | None = [] if eval_batches_kept else None
        size = 0
        for batch in iter_batches(make_reader(), eval_batches):
            batch = batch.cast(compute_dtype)
            size += batch.nbytes
            if kept is not None and size > cfg.eval_cache_gib * 2**30:
                kept, eval_batches_kept = None, False
            if kept is not None:
                # On the host whatever the reader made (an online one's are on the GPU already).
                batch = batch.on_host(pin=device.type == "cuda")
                kept.append(batch)
            yield batch
        eval_cache = kept

    def evaluate() -> dict[str, Any]:
        model.eval()
        totals = StepStats(*(torch.zeros(cfg.ttt_steps, dtype=torch.float64, device=device)
                             for _ in range(3)))
        ks = range(1, cfg.ttt_steps + 1)
        # Greedy chains over the held-out sequences with k drafts per cycle: tokens and
        # verify cycles, pooled over every cycle as SGLang counts (tasks.draft.acceptance).
        chains = torch.zeros(2, cfg.ttt_steps, dtype=torch.float64)
        agreement = torch.zeros(2, dtype=torch.float64)  # response tokens that are the target's argmax, of all
        with torch.no_grad(), autocast:
            for batch in eval_source():
                rows = counted_rows(batch.loss_mask, cfg.ttt_steps, device)
                _, stats, predicted, teacher_argmax = model.unrolled(
                    batch.to(device, compute_dtype), rows, cfg.ttt_steps, cfg.ttt_decay, cfg.logits_chunk,
                    full_vocab=True)  # fmt: skip
                agreement += torch.tensor(agreement_counts(teacher_argmax, batch.input_ids, batch.loss_mask),
                                          dtype=torch.float64)  # fmt: skip
                totals = totals.merged(stats)
                matches = stored_token_matches(predicted, rows, batch.input_ids, cfg.ttt_steps)
                for k, (tokens, cycles) in chain_totals(matches.numpy(), batch.loss_mask.numpy(), ks).items():
                    chains[0, k - 1] += tokens
                    chains[1, k - 1] += cycles
        model.train()
        for t in (totals.loss_sum, totals.correct, totals.count):
            rank.sum_(t)
        chains = rank.sum_(chains.to(device)).cpu()
        agreed, responses = rank.sum_(agreement.to(device)).tolist()
        pooled = {f"pooled_accept_len_{k}": pooled_accept_length(chains[0, k - 1].item(), chains[1, k - 1].item())
                  for k in ks}  # fmt: skip
        return {"step": step, "acc_basis": "full_vocab", **summarize(totals, cfg.ttt_decay), **pooled,
                "target_agreement": agreed / responses if responses else None, "target_agreement_tokens": int(responses),
                "eval_batches_kept": eval_batches_kept}  # fmt: skip

    def save(best_changed: bool) -> None:
        nonlocal last_saved
        last_saved = ckpt.checkpoint_key(step)
        if rank.rank == 0:
            trainer_state = {**state, "hidden_states": cfg.hidden_states, "train_sequences": len(index.split("train")),
                             "holdout": data_meta.get("holdout"),
                             "recipe": recipe,
                             "step": step, "epoch": step // steps_per_epoch,
                             "batch_in_epoch": step % steps_per_epoch,
                             "steps_per_epoch": steps_per_epoch, "total_steps": total_steps}
            ckpt.save_checkpoint(run, step, draft, optimizer, scheduler, trainer_state)
            if best_changed:
                run.write_json_atomic(TRAIN_BEST, {**state["best"], "checkpoint": last_saved})
            best_key = ckpt.checkpoint_key(state["best"]["step"]) if state["best"] else None
            ckpt.prune_checkpoints(run, keep_checkpoints, {best_key} if best_key else set())
            if callbacks.on_checkpoint:
                callbacks.on_checkpoint(last_saved)
        rank.barrier()

    def training_window() -> dict[str, Any]:
        """Gradient norms and clipping over the training steps since the previous evaluation, and
        how long a step took and waited for its batch (an input-bound trainer shows here)."""
        since = state["evals"][-1]["step"] if state["evals"] else 0
        window = [h for h in state["history"] if since < h["step"] <= step]
        if not window:
            return {}
        norms = [h["grad_norm"] for h in window]
        clipped = sum(1 for n in norms if n > cfg.max_grad_norm)
        timed = [h for h in window if "data_wait_s" in h]  # a resumed run's history before the field has none
        times = {"train_step_s": sum(h["batch_tokens"] / h["tok_per_s"] for h in timed) / len(timed),
                 "train_data_wait_s": sum(h["data_wait_s"] for h in timed) / len(timed)} if timed else {}  # fmt: skip
        return {"train_steps": len(norms), "train_grad_norm": sum(norms) / len(norms),
                "train_grad_norm_max": max(norms), "train_clip_rate": clipped / len(norms), **times}

    def record_eval() -> bool:
        result = {**evaluate(), **training_window()}
        if device.type == "cuda":  # what sizing batch_tokens (or sharing the GPU) needs to know
            result.update(cuda_peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                          cuda_peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30)  # fmt: skip
        state["evals"].append(result)
        better = step > 0 and (state["best"] is None or result["sim_accept"] > state["best"]["sim_accept"])
        if better:
            state["best"] = {"step": step, "sim_accept": result["sim_accept"],
                             "sim_accept_len": result["sim_accept_len"]}
        if rank.rank == 0:
            run.write_bytes_atomic(TRAIN_PLOT, accuracy_plot_png(state["evals"], state["history"],
                                                                 cfg.max_grad_norm))
            if callbacks.on_eval:
                callbacks.on_eval(result)
        return better

    if step == 0 and eval_batches:
        record_eval()  # the untrained baseline
        # Before the first step: are the replies the target's own? (a server of other weights)
        check_target_agreement(state["evals"][-1], cfg.min_target_agreement, greedy_replies(run), run.url)
    elif eval_batches and step < total_steps:
        # A resumed draft reads (online: captures) its held-out batches now, as a fresh one does in
        # its untrained evaluation, so that its first evaluation costs what every later one does
        # and the set-up before its first step says what it takes: run 23's first evaluation
        # after its resume took 58.6 s with its save, the capture of 793 sequences included,
        # against 9.7 s, and the node's watch counted that for every evaluation left.
        for _ in eval_source():
            pass

    # -- the loop --------------------------------------------------------------------------
    reader = make_reader()
    model.train()
    if rank.rank == 0 and callbacks.on_ready:
        callbacks.on_ready()
    while step < total_steps:
        epoch, start = divmod(step, steps_per_epoch)
        batches = rank_batches(plan_epoch(index, "train", epoch, cfg.seed, cfg.batch_tokens),
                               rank.rank, rank.world)
        asked = time.perf_counter()
        for batch in iter_batches(reader, batches, start, pin=device.type == "cuda"):
            began = time.perf_counter()
            # How long the step waited for its batch (read, captured online, padded, pinned by the
            # worker thread): ~0 while that thread keeps ahead of the GPU, the step's share otherwise.
            data_wait = began - asked
            lr = scheduler.get_last_lr()[0]
            stats, grad_norm = train_step(stepper, batch, cfg, device, compute_dtype, params,
                                          optimizer, scheduler, step, rank.rank)
            step += 1
            for t in (stats.loss_sum, stats.correct, stats.count):
                rank.sum_(t)
            tokens = rank.sum_(torch.tensor(float(batch.tokens), device=device)).item()
            elapsed = time.perf_counter() - began
            # Training accuracies use the teacher's argmax within the draft vocabulary (no
            # full-vocabulary matmul per step); evaluations use the full vocabulary.
            # The norm before clipping (clip_grad_norm_'s return), of this rank's gradient after
            # DDP's all-reduce: the same on every rank.
            record = {"step": step, "lr": lr, "grad_norm": float(grad_norm),
                      "clipped": float(grad_norm) > cfg.max_grad_norm, "batch_tokens": tokens,
                      "tok_per_s": tokens / elapsed, "data_wait_s": data_wait, "acc_basis": "draft_vocab",
                      **summarize(stats, cfg.ttt_decay)}
            state["history"].append(record)
            if rank.rank == 0 and callbacks.on_step:
                callbacks.on_step(record)
            final = step == total_steps
            better = record_eval() if eval_batches and (step % cfg.eval_every == 0 or final) else False
            if step % cfg.save_every == 0 or better or final:
                save(better)
            if final:
                break
            asked = time.perf_counter()

    if source is not None:
        source.close()
    result = TrainResult(step, state["history"], state["evals"], state["best"], last_saved,
                         resumed_from, vocab.stats)
    if rank.rank == 0:
        history = [{k: h[k] for k in HISTORY_COLUMNS if k in h} for h in state["history"]]
        run.write_json_atomic(TRAIN_RESULT, {"steps": step, "best": state["best"],
                                           "last_checkpoint": last_saved, "resumed_from": resumed_from,
                                           "recipe": recipe, "evals": state["evals"], "history": history,
                                           "vocab": vocab.stats})
    return result
