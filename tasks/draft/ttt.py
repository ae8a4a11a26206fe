"""Training-time test: unroll the draft `steps` times over a batch, as it runs when serving.

Shift (SpecForge's and SGLang's): at unroll step k, batch index t holds the token at t+1+k,
rope position t+k, and the hidden state the draft produced at index t in step k-1 (step 0:
fc of the target's aux states at t). It predicts the token at t+2+k; its teacher is the
target's distribution at position t+1+k (last_hidden @ lm_head.T, restricted to the draft
vocabulary and renormalized). Step k's query at t attends to step 0's keys at 0..t (causal)
and to its own earlier steps' keys at index t: at serving time those are the extend over
the accepted tokens and the draft's own earlier tokens in this cycle.

Counted positions: index t counts at step k when the predicted token (t+2+k) exists and is a
response token (loss_mask); the loss is the soft cross-entropy averaged over them, weighted
decay**k across steps. acc_k compares the draft's argmax (mapped to target ids) with the
target's argmax over the FULL target vocabulary, so a token outside the draft vocabulary is
a miss; in training steps (`full_vocab=False`) the teacher's argmax within the draft
vocabulary stands in for it, which saves the full-vocabulary matmul.

Loss normalisation: step k's counted positions weigh decay**k / n_k (n_k of them in this batch:
the per-batch mean, `loss_denominator=None`) or decay**k / D for a fixed D (train.batch_tokens:
every token weighs the same whatever its batch's fill).

Simulated acceptance: `sim_accept` = sum_k prod_{j<=k} acc_j counts accepted DRAFT tokens per
cycle; SGLang's "accept length" also counts the target's bonus token, i.e. 1 + sim_accept,
reported as `sim_accept_len`. It treats every position as a cycle's start and the steps'
accuracies as independent. What a server counts instead, tokens per verify cycle pooled over
every cycle of every sequence (tasks.draft.acceptance), comes from `stored_token_matches`:
the trainer's evaluation walks the greedy chains over them (`pooled_accept_len_k`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tasks.draft import objectives
from tasks.draft.model import Eagle3Draft
from tasks.draft.objectives import soft_ce_rows
from tasks.draft.ttt_attention import TTTAttention


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, T], right-padded
    loss_mask: torch.Tensor  # bool [B, T], False on padding
    aux_hidden: torch.Tensor  # [B, T, 3H]
    last_hidden: torch.Tensor  # [B, T, H]
    lengths: torch.Tensor  # int64 [B]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Batch:
        """On `device` (hidden states in `dtype`); lengths stay on the host. Host tensors are
        pinned first, so the copies queue behind the GPU's work instead of waiting for it."""
        device = torch.device(device)
        return Batch(
            to_device(self.input_ids, device),
            to_device(self.loss_mask, device),
            to_device(self.aux_hidden, device, dtype),
            to_device(self.last_hidden, device, dtype),
            self.lengths,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.input_ids, self.loss_mask, self.aux_hidden,
                                                          self.last_hidden, self.lengths))  # fmt: skip

    def cast(self, dtype: torch.dtype) -> Batch:
        """The same batch with its hidden states in `dtype`, where it lies: what `to(device,
        dtype)` would make of them, done once (float32 to bfloat16 rounds to nearest even on the
        host as on a GPU)."""
        return Batch(self.input_ids, self.loss_mask, self.aux_hidden.to(dtype), self.last_hidden.to(dtype),
                     self.lengths)  # fmt: skip

    def _each(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """`fn` applied to ids, mask and states; lengths stay as they are (always on the host)."""
        return Batch(fn(self.input_ids), fn(self.loss_mask), fn(self.aux_hidden), fn(self.last_hidden), self.lengths)

    def pinned(self) -> Batch:
        """Host tensors page-locked; tensors already on a GPU stay where they are."""
        return self._each(lambda t: t.pin_memory() if t.device.type == "cpu" else t)

    def on_host(self, pin: bool) -> Batch:
        """The same batch with every tensor on the host, page-locked if `pin` (a GPU tensor is
        copied once, straight into page-locked memory)."""

        def host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu":
                return t.pin_memory() if pin else t
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t)

        return self._each(host)


def to_device(x: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy that never blocks the host: a pageable host tensor is pinned before the copy
    (a pageable copy would wait for the whole stream)."""
    if device.type == "cuda" and x.device.type == "cpu" and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, dtype, non_blocking=True)


def counted_rows(loss_mask: torch.Tensor, steps: int, device: torch.device) -> list[tuple]:
    """Per unroll step k: flat indices (into B*T) of the positions it counts, the flat
    indices of their teachers (one position later + k), and how many. A position counts
    when the token it predicts (t+2+k) exists and is a response token. Computed from the
    host mask, so the unroll never waits on the GPU."""
    mask = loss_mask.cpu()
    device = torch.device(device)
    out = []
    for k in range(steps):
        # t+2+k < T, so the teacher at flat + 1 + k stays inside the same row.
        flat = shift_left(mask, 2 + k, False).flatten().nonzero().flatten()
        out.append((to_device(flat, device), to_device(flat + 1 + k, device), flat.numel()))
    return out


class SoftCrossEntropy(torch.autograd.Function):
    """sum_i weight[i] * (logsumexp(z_i) - p_i.z_i), its gradient made in the forward pass.

    (softmax(z) - p) * weight is all the backward needs, so neither fp32 logits nor their
    log-softmax stay alive; rows go in chunks to bound the fp32 temporaries. Also returns the
    unweighted per-row losses (no gradient) for the per-step statistics.
    """

    @staticmethod
    def forward(ctx, logits, probs, index, weight, chunk: int, rows_fn=soft_ce_rows):
        grad = torch.empty_like(logits)
        per_row = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            end = start + chunk
            per_row[start:end], grad[start:end] = rows_fn(
                logits[start:end], probs, index[start:end], weight[start:end]
            )
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(per_row)
        return (per_row * weight).sum(), per_row

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _unused: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None, None, None, None


@dataclass
class Teacher:
    """The target's side for a batch: draft-vocab distribution and argmax, per position."""

    probs: torch.Tensor  # float32 [B, T, draft_vocab] (row t: the target at position t)
    argmax: torch.Tensor  # int64 [B, T]: target token ids (full vocab or draft vocab)


@torch.no_grad()
def compute_teacher(
    last_hidden: torch.Tensor,
    lm_head: torch.Tensor,
    draft_ids: torch.Tensor,
    chunk: int,
    full_vocab: bool,
) -> Teacher:
    """Target logits in chunks of `chunk` tokens, so a 128k vocabulary never meets the batch."""
    b, t, h = last_hidden.shape
    flat = last_hidden.reshape(b * t, h)
    head_draft = lm_head[draft_ids]
    probs = torch.empty(b * t, draft_ids.numel(), dtype=torch.float32, device=flat.device)
    argmax = torch.empty(b * t, dtype=torch.int64, device=flat.device)
    for start in range(0, b * t, chunk):
        rows = flat[start : start + chunk]
        if full_vocab:
            logits = (rows @ lm_head.T).float()
            argmax[start : start + chunk] = logits.argmax(-1)
            draft_logits = logits[:, draft_ids]
        else:
            draft_logits = (rows @ head_draft.T).float()
            argmax[start : start + chunk] = draft_ids[draft_logits.argmax(-1)]
        probs[start : start + chunk] = torch.softmax(draft_logits, dim=-1)
    return Teacher(probs.view(b, t, -1), argmax.view(b, t))


def agreement_counts(argmax: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int]:
    """How many response tokens are the target's argmax where it predicts them, of how many:
    `argmax` [B, T] is the target's full-vocabulary argmax at each position (Teacher.argmax with
    full_vocab), against the stored token at p+1 wherever that is a response token (loss_mask)."""
    response = loss_mask[:, 1:].to(argmax.device)
    hits = argmax[:, :-1][response] == input_ids[:, 1:].to(argmax.device)[response]
    return int(hits.sum()), int(hits.numel())


@torch.no_grad()
def target_agreement(
    last_hidden: torch.Tensor, lm_head: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, chunk: int
) -> tuple[int, int]:
    """agreement_counts from the target's last hidden states (last_hidden @ lm_head.T over the
    full vocabulary, `chunk` positions at a time). Replies the target itself regenerated greedily
    agree at ~99% (bf16 near-ties aside); another model's replies to the same prompts far less
    (BENCHMARKS P29: 0.991 against 0.749 on Qwen2.5-Coder-1.5B-Instruct)."""
    flat = last_hidden.reshape(-1, last_hidden.shape[-1]).to(lm_head.dtype)
    argmax = torch.cat([(flat[i : i + chunk] @ lm_head.T).argmax(-1) for i in range(0, flat.shape[0], chunk)])
    return agreement_counts(argmax.view(last_hidden.shape[:2]), input_ids, loss_mask)


@dataclass
class StepStats:
    """Sums over counted positions, per unroll step (all-reducible as they are)."""

    loss_sum: torch.Tensor  # float64 [steps]
    correct: torch.Tensor  # float64 [steps]
    count: torch.Tensor  # float64 [steps]

    def merged(self, other: StepStats) -> StepStats:
        return StepStats(
            self.loss_sum + other.loss_sum, self.correct + other.correct, self.count + other.count
        )


def summarize(stats: StepStats, decay: float) -> dict[str, float]:
    """Per-step loss and accuracy, the weighted loss, and the simulated acceptance lengths."""
    count = stats.count.double().cpu().clamp_min(1)
    losses = (stats.loss_sum.double().cpu() / count).tolist()
    accs = (stats.correct.double().cpu() / count).tolist()
    out: dict[str, float] = {"positions": float(stats.count[0])}
    out["loss"] = float(sum(decay**k * loss for k, loss in enumerate(losses)))
    run, sim = 1.0, 0.0
    for k, (loss, acc) in enumerate(zip(losses, accs, strict=True)):
        out[f"loss_{k}"], out[f"acc_{k}"] = float(loss), float(acc)
        run *= acc
        sim += run
    out["sim_accept"] = sim
    out["sim_accept_len"] = 1.0 + sim
    return out


def stored_token_matches(
    predicted: torch.Tensor, rows: list[tuple], input_ids: torch.Tensor, steps: int
) -> torch.Tensor:
    """bool [steps, B, T] on the CPU: [k, b, t] = the draft's step-k token at index t (target
    id; `predicted` as TTTModel.unrolled returns it, counted rows of every step in order) equals
    the stored token at t+2+k. False where step k does not count t. The layout
    tasks.draft.acceptance walks, as tasks.gate.replay.draft_matches gives it per sequence."""
    b, t = input_ids.shape
    ids = input_ids.flatten().cpu()
    out = torch.zeros(steps, b * t, dtype=torch.bool)
    predicted = predicted.cpu()
    start = 0
    for k, (flat, _, n) in enumerate(rows):
        flat = flat.cpu()
        out[k, flat] = predicted[start : start + n] == ids[flat + 2 + k]
        start += n
    return out.view(steps, b, t)


def shift_left(x: torch.Tensor, by: int, fill: int | bool = 0) -> torch.Tensor:
    """x[:, t + by] at t, `fill` past the end."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], by), fill)
    return torch.cat([x[:, by:], pad], dim=1)


def unroll(
    draft: Eagle3Draft,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    steps: int,
    use_flash: bool | None = None,
    compiled: bool = False,
) -> Iterator[torch.Tensor]:
    """The draft's output hidden state [B, T, H] (pre-norm) at each unroll step, in order."""
    b, t = input_ids.shape
    groups = draft.config.num_attention_heads // draft.config.num_key_value_heads
    attention = TTTAttention(groups, use_flash, compiled)
    index = torch.arange(t, device=input_ids.device)
    hidden = draft.project(aux_hidden)
    for k in range(steps):
        positions = (index + k).expand(b, t)
        hidden = draft.layer(shift_left(input_ids, 1 + k), hidden, positions, attention)
        yield hidden


class TTTModel(nn.Module):
    """The draft plus the target's frozen lm_head: forward(batch) -> (loss, stats).

    A module of its own so DDP can wrap the whole unroll (its hooks need forward() calls).
    """

    def __init__(
        self,
        draft: Eagle3Draft,
        lm_head: torch.Tensor,
        draft_ids: torch.Tensor,
        compile_kernels: bool = False,
        objective: str = "soft_ce",
    ) -> None:
        super().__init__()
        self.draft = draft
        self.register_buffer("target_lm_head", lm_head.detach(), persistent=False)
        self.register_buffer("draft_ids", draft_ids.to(torch.int64), persistent=False)
        rows = objectives.objective(objective).rows
        self.ce_rows = rows
        self.compile_kernels = compile_kernels
        if compile_kernels:
            # In place, so parameter names stay SGLang's: norms, RoPE, SwiGLU, residuals
            # and the loss rows fuse; attention and the big matmuls keep their kernels.
            draft.midlayer.compile_parts()
            draft.norm.compile(dynamic=True)
            self.ce_rows = torch.compile(rows, dynamic=True)

    def forward(
        self,
        batch: Batch,
        rows: list[tuple],
        steps: int,
        decay: float,
        logits_chunk: int,
        full_vocab: bool = False,
        loss_denominator: float | None = None,
    ) -> tuple[torch.Tensor, StepStats]:
        """`rows` = counted_rows(cpu loss mask, steps, device); `loss_denominator` None: each
        step's mean over its counted positions, else the fixed denominator (module docstring)."""
        loss, stats, _, _ = self.unrolled(batch, rows, steps, decay, logits_chunk, full_vocab,
                                          loss_denominator)
        return loss, stats

    def unrolled(
        self,
        batch: Batch,
        rows: list[tuple],
        steps: int,
        decay: float,
        logits_chunk: int,
        full_vocab: bool = False,
        loss_denominator: float | None = None,
    ) -> tuple[torch.Tensor, StepStats, torch.Tensor, torch.Tensor]:
        """forward's loss and statistics, the draft's token (target id) at every counted row of
        every step in order, for stored_token_matches, and the teacher's argmax [B, T] (over the
        full vocabulary with `full_vocab`: agreement_counts)."""
        draft = self.draft
        teacher = compute_teacher(
            batch.last_hidden, self.target_lm_head, self.draft_ids, logits_chunk, full_vocab
        )
        device = batch.input_ids.device
        sizes = [n for _, _, n in rows]
        # Every step's counted rows go through norm, lm_head and the loss together: one
        # matmul and one weight gradient instead of seven accumulated ones.
        selected = []
        for k, hidden in enumerate(unroll(draft, batch.input_ids, batch.aux_hidden, steps,
                                          compiled=self.compile_kernels)):
            selected.append(hidden.flatten(0, 1).index_select(0, rows[k][0]))
        count = torch.tensor(sizes, dtype=torch.float64)
        if sum(sizes) == 0:
            # Nothing counted: touch every parameter at zero weight, so the backward (and
            # DDP's gradient buckets) still see all of them.
            zero = draft.logits(hidden[:1, 0]).float().sum() * 0.0
            nothing = torch.zeros(steps, dtype=torch.float64, device=device)
            none_predicted = torch.zeros(0, dtype=torch.int64, device=device)
            return zero, StepStats(nothing, nothing.clone(), count.to(device)), none_predicted, teacher.argmax
        if loss_denominator is None:  # today's per-batch mean, the expression kept bit for bit
            weights = torch.cat([torch.full((n,), decay**k / max(n, 1)) for k, n in enumerate(sizes)])
        else:
            weights = torch.cat([torch.full((n,), decay**k / loss_denominator) for k, n in enumerate(sizes)])
        segment = torch.repeat_interleave(torch.arange(steps), torch.tensor(sizes))
        teacher_at = torch.cat([t for _, t, _ in rows])
        logits = draft.logits(torch.cat(selected))
        loss, per_row = SoftCrossEntropy.apply(
            logits, teacher.probs.flatten(0, 1), teacher_at, to_device(weights, device),
            logits_chunk, self.ce_rows,
        )
        with torch.no_grad():
            segment = to_device(segment, device)
            predicted = self.draft_ids[logits.argmax(-1)]
            hit = (predicted == teacher.argmax.flatten().index_select(0, teacher_at)).double()
            loss_sum = torch.zeros(steps, dtype=torch.float64, device=device)
            loss_sum.index_add_(0, segment, per_row.double())
            correct = torch.zeros(steps, dtype=torch.float64, device=device).index_add_(
                0, segment, hit
            )
        return loss, StepStats(loss_sum, correct, count.to(device)), predicted, teacher.argmax
