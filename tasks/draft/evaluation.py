"""The draft's held-out evaluation during training: the held-out batches (read once and kept),
the metrics of one evaluation, the training window since the one before, and the check, at the
untrained evaluation, that the replies are the target's own.

Curves: every evaluation records the held-out metrics, and the mean and largest gradient norm and
the fraction of steps clipped since the previous evaluation (`train_grad_norm`,
`train_grad_norm_max`, `train_clip_rate`); train/result.json keeps them, the plot draws them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tasks.config import TrainConfig
from tasks.draft.acceptance import chain_totals, pooled_accept_length
from tasks.draft.data import SeqRef, SequenceReader, iter_batches
from tasks.draft.distributed import Dist
from tasks.draft.train_setup import TrainError
from tasks.draft.ttt import (
    Batch,
    StepStats,
    TTTModel,
    agreement_counts,
    counted_rows,
    stored_token_matches,
    summarize,
)
from tasks.runfolder import RunFolder
from tasks.runfolder.fingerprint import RUN_JSON


class HeldOut:
    """The held-out batches, read once (online: captured once) and kept on the host between
    evaluations, in compute_dtype (what each evaluation casts them to anyway: the same values at
    half float32's bytes) and page-locked on a GPU, so that an evaluation only copies them. Kept
    in float32 and pinned anew by every evaluation, 793 held-out sequences of Qwen2.5-Coder were 15
    GiB (~12 s an evaluation with its save, against ~6 s for 205: BENCHMARKS P25, P26). Past `cache_gib` none
    are kept and each evaluation reads them again: the held-out split grows with the data."""

    def __init__(self, batches: list[list[SeqRef]], make_reader: Callable[[], SequenceReader],
                 compute_dtype: torch.dtype, pin: bool, cache_gib: float) -> None:  # fmt: skip
        self.batches, self.make_reader = batches, make_reader
        self.compute_dtype, self.pin, self.cache_gib = compute_dtype, pin, cache_gib
        self.cache: list[Batch] | None = None  # None until a pass has read them all within the budget
        self.kept = True  # False once past cache_gib: every evaluation reads them again

    def __bool__(self) -> bool:
        return bool(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        if self.cache is not None:
            yield from self.cache
            return
        kept: list[Batch] | None = [] if self.kept else None
        size = 0
        for batch in iter_batches(self.make_reader(), self.batches):
            batch = batch.cast(self.compute_dtype)
            size += batch.nbytes
            if kept is not None and size > self.cache_gib * 2**30:
                kept, self.kept = None, False
            if kept is not None:
                # On the host whatever the reader made (an online one's are on the GPU already).
                batch = batch.on_host(pin=self.pin)
                kept.append(batch)
            yield batch
        self.cache = kept

    def read(self) -> None:
        """Read (online: capture) them now, keeping what fits, as a first evaluation would."""
        for _ in self:
            pass


def _held_out_sums(model: TTTModel, held_out: HeldOut, cfg: TrainConfig,
                   device: torch.device) -> tuple[StepStats, torch.Tensor, torch.Tensor]:  # fmt: skip
    """This rank's sums over its held-out batches: the unroll's per-step stats; tokens and
    verify cycles of greedy chains of k drafts (rows 0 and 1, column k-1), pooled over every
    cycle as SGLang counts them (tasks.draft.acceptance); and response tokens that are the
    target's argmax, of all."""
    compute_dtype = held_out.compute_dtype
    autocast = torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32)
    totals = StepStats(*(torch.zeros(cfg.ttt_steps, dtype=torch.float64, device=device) for _ in range(3)))
    ks = range(1, cfg.ttt_steps + 1)
    chains = torch.zeros(2, cfg.ttt_steps, dtype=torch.float64)
    agreement = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), autocast:
        for batch in held_out:
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
    return totals, chains, agreement


def evaluate(model: TTTModel, held_out: HeldOut, cfg: TrainConfig, device: torch.device, rank: Dist,
             step: int) -> dict[str, Any]:  # fmt: skip
    """The held-out metrics at `step`, summed over every rank: per-step loss and full-vocabulary
    accuracy, simulated and pooled accept lengths, and the share of response tokens that are the
    target's argmax."""
    model.eval()
    totals, chains, agreement = _held_out_sums(model, held_out, cfg, device)
    model.train()
    for t in (totals.loss_sum, totals.correct, totals.count):
        rank.sum_(t)
    chains = rank.sum_(chains.to(device)).cpu()
    agreed, responses = rank.sum_(agreement.to(device)).tolist()
    pooled = {f"pooled_accept_len_{k}": pooled_accept_length(chains[0, k - 1].item(), chains[1, k - 1].item())
              for k in range(1, cfg.ttt_steps + 1)}  # fmt: skip
    return {"step": step, "acc_basis": "full_vocab", **summarize(totals, cfg.ttt_decay), **pooled,
            "target_agreement": agreed / responses if responses else None, "target_agreement_tokens": int(responses),
            "eval_batches_kept": held_out.kept}  # fmt: skip


def training_window(state: dict[str, Any], step: int, max_grad_norm: float) -> dict[str, Any]:
    """Gradient norms and clipping over the training steps since the previous evaluation, and
    how long a step took and waited for its batch (an input-bound trainer shows here)."""
    since = state["evals"][-1]["step"] if state["evals"] else 0
    window = [h for h in state["history"] if since < h["step"] <= step]
    if not window:
        return {}
    norms = [h["grad_norm"] for h in window]
    clipped = sum(1 for n in norms if n > max_grad_norm)
    timed = [h for h in window if "data_wait_s" in h]  # a resumed run's history before the field has none
    times = {"train_step_s": sum(h["batch_tokens"] / h["tok_per_s"] for h in timed) / len(timed),
             "train_data_wait_s": sum(h["data_wait_s"] for h in timed) / len(timed)} if timed else {}  # fmt: skip
    return {"train_steps": len(norms), "train_grad_norm": sum(norms) / len(norms),
            "train_grad_norm_max": max(norms), "train_clip_rate": clipped / len(norms), **times}


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
