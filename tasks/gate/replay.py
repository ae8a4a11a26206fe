"""Offline acceptance replay: greedy chain speculation (topk=1) on stored target states.

For a greedy target the stored response IS the target's output, so which draft tokens a
verify step would accept is decided by the stored tokens alone, and the target's states the
draft reads (the aux hidden states of the confirmed tokens) are the stored ones.

One training-time-test unroll of K steps (tasks.draft.ttt.unroll) gives, at every index t and
step j, the draft's token for position t+2+j when drafting starts after confirmed token t+1.
The unroll feeds the stored token at each step where decoding feeds the draft's own previous
token; the two differ only after a mismatch, where the chain has already stopped. So for a
cycle that starts with x_c the last confirmed token, the accepted drafts are the leading run
of matches at index c-1, steps 0..k-1; c then advances past the accepted tokens and the bonus.

Counted: each maximal run of loss-masked (response) positions [s, e] is one decode; x_s comes
from prefill, the cycles produce x_{s+1}..x_e (the last cycle stops at e, as a request
stops at its length limit or stop token). Accept length = tokens per verify (accepted + bonus),
pooled over all counted cycles (tasks.draft.acceptance, as SGLang and vLLM count it and as the
trainer's held-out `pooled_accept_len_k` does); confidence intervals resample sequences (seeded
bootstrap of the ratio of sums).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from tasks.draft.acceptance import pooled_accept_length, replay_cycles, response_segments
from tasks.draft.model import Eagle3Draft
from tasks.draft.ttt import unroll

if TYPE_CHECKING:
    from tasks.runfolder import RunFolder


class ReplaySequence(Protocol):
    """What replay reads of a sequence (tasks.extract.storage.ExtractedSequence has it)."""

    sequence_id: str
    domain: str
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # bool [T]
    aux_hidden: torch.Tensor  # [T, 3H]


@dataclass
class SequenceReplay:
    sequence_id: str
    domain: str
    emitted: dict[int, list[int]] = field(default_factory=dict)  # num_steps -> tokens per verify
    accepted: dict[int, list[int]] = field(default_factory=dict)  # num_steps -> drafts accepted

    def tokens(self, k: int) -> int:
        return sum(self.emitted[k])

    def cycles(self, k: int) -> int:
        return len(self.emitted[k])


@torch.no_grad()
def draft_matches(draft: Eagle3Draft, seq: ReplaySequence, max_steps: int) -> torch.Tensor:
    """bool [max_steps, T] on the CPU: [j, t] = the unroll's step-j token at index t equals the
    stored token at t+2+j (False past the end)."""
    param = draft.lm_head.weight
    expected = draft.fc.in_features
    if seq.aux_hidden.shape[-1] != expected:
        raise ValueError(
            f"sequence {seq.sequence_id}: aux_hidden is {seq.aux_hidden.shape[-1]} wide, the draft's fc "
            f"takes {expected} (target hidden x aux layers): wrong draft or extraction"
        )
    ids = seq.input_ids.to(param.device, torch.long)[None]
    aux = seq.aux_hidden.to(param.device, param.dtype)[None]
    t = ids.shape[1]
    out = torch.zeros(max_steps, t, dtype=torch.bool)
    for j, hidden in enumerate(unroll(draft, ids, aux, max_steps)):
        draft_ids = draft.logits(hidden[0]).argmax(-1)
        predicted = (draft_ids + draft.d2t[draft_ids]).cpu()
        if t > 2 + j:
            out[j, : t - 2 - j] = predicted[: t - 2 - j] == seq.input_ids[2 + j :].cpu().long()
    return out


def replay_sequences(
    draft: Eagle3Draft, seqs: Iterable[ReplaySequence], num_steps: Sequence[int]
) -> list[SequenceReplay]:
    steps = sorted(set(num_steps))
    if not steps or steps[0] < 1:
        raise ValueError(f"num_steps must be integers >= 1, got {list(num_steps)}")
    was_training = draft.training
    draft.eval()
    out = []
    try:
        for seq in seqs:
            segments = response_segments(seq.loss_mask)
            record = SequenceReplay(seq.sequence_id, seq.domain)
            if segments:
                matches = draft_matches(draft, seq, steps[-1])
                for k in steps:
                    record.emitted[k], record.accepted[k] = replay_cycles(matches, segments, k)
            else:
                record.emitted = {k: [] for k in steps}
                record.accepted = {k: [] for k in steps}
            out.append(record)
    finally:
        draft.train(was_training)
    return out


def accept_stats(
    records: list[SequenceReplay], k: int, n_bootstrap: int, seed: int, ci_level: float
) -> dict[str, Any]:
    """Accept length (tokens per verify) with a bootstrap CI over sequences, and per-position
    acceptance: P(draft token j accepted) over the cycles that drafted it."""
    pooled = pooled_with_ci([r.tokens(k) for r in records], [r.cycles(k) for r in records], n_bootstrap, seed,
                            ci_level)  # fmt: skip
    if pooled["accept_length"] is None:
        return {**pooled, "accept_per_position": []}
    accepted = np.array([a for r in records for a in r.accepted[k]], dtype=np.int64)
    per_position = [float((accepted >= j).mean()) for j in range(1, k + 1)]
    return {**pooled, "accept_per_position": per_position}


def pooled_with_ci(
    tokens_per_sequence: Sequence[int], cycles_per_sequence: Sequence[int], n_bootstrap: int, seed: int,
    ci_level: float,
) -> dict[str, Any]:
    """Tokens per verify pooled over sequences, with a bootstrap CI that resamples sequences."""
    tokens = np.asarray(tokens_per_sequence, dtype=np.float64)
    cycles = np.asarray(cycles_per_sequence, dtype=np.float64)
    total_cycles = cycles.sum()
    if total_cycles == 0:
        return {"accept_length": None, "ci_low": None, "ci_high": None, "cycles": 0, "tokens": 0,
                "sequences": len(tokens)}  # fmt: skip
    point = pooled_accept_length(tokens.sum(), total_cycles)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(tokens), size=(n_bootstrap, len(tokens)))
    boot_cycles = cycles[pick].sum(1)
    ratios = tokens[pick].sum(1)[boot_cycles > 0] / boot_cycles[boot_cycles > 0]
    alpha = (1.0 - ci_level) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha]) if len(ratios) else (point, point)
    return {"accept_length": point, "ci_low": float(low), "ci_high": float(high), "cycles": int(total_cycles),
            "tokens": int(tokens.sum()), "sequences": len(tokens)}  # fmt: skip


def paired_bootstrap(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray] | None, n: int, seed: int,
                     level: float) -> dict[str, Any]:  # fmt: skip
    """Pooled accept length (sum tokens / sum cycles) of `a` over its units with its CI; with `b`
    (the same units), b's too and a / b and a - b with theirs: the units resampled together
    (seeded)."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(a[0]), size=(n, len(a[0])))

    def pooled(u: tuple[np.ndarray, np.ndarray]) -> tuple[float, np.ndarray]:
        return float(u[0].sum() / u[1].sum()), u[0][pick].sum(1) / u[1][pick].sum(1)

    q = [(1 - level) / 2, 1 - (1 - level) / 2]

    def ci(x: np.ndarray) -> list[float]:
        return [float(v) for v in np.quantile(x, q)]

    pa, ba = pooled(a)
    if b is None:
        return {"accept_length": pa, "ci": ci(ba)}
    pb, bb = pooled(b)
    return {"accept_length": pa, "ci": ci(ba), "anchor_accept_length": pb, "anchor_ci": ci(bb),
            "ratio": pa / pb, "ratio_ci": ci(ba / bb), "difference": pa - pb, "difference_ci": ci(ba - bb)}  # fmt: skip


def replayed_on(replayed: dict[str, Any], sequence_ids: set[str], k: int) -> dict[str, Any] | None:
    """A replay.json's accept length at num_steps `k` over the sequences in `sequence_ids` alone
    (its per-sequence records; its own bootstrap settings), e.g. another run's held-out set that
    this one shares, so that drafts trained on different data compare on the same sequences.
    None when it kept no per-sequence records (one written before they were kept) or did not
    replay `k`."""
    if "per_sequence" not in replayed or str(k) not in replayed["overall"]:
        return None
    records = [r for r in replayed["per_sequence"] if r["sequence_id"] in sequence_ids]
    settings = replayed["settings"]
    return pooled_with_ci([r["tokens"][str(k)] for r in records], [r["cycles"][str(k)] for r in records],
                          settings["n_bootstrap"], settings["seed"], settings["ci_level"])  # fmt: skip


@dataclass
class ReplayResult:
    num_steps: list[int]
    overall: dict[int, dict[str, Any]]
    per_domain: dict[str, dict[int, dict[str, Any]]]
    sequences: list[SequenceReplay]
    settings: dict[str, Any]

    def accept_lengths(self, domain: str | None = None) -> dict[int, float]:
        table = self.overall if domain is None else self.per_domain[domain]
        return {k: s["accept_length"] for k, s in table.items() if s["accept_length"] is not None}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (num_steps keys as strings): the stats, and each sequence's tokens and
        cycles per num_steps (not its cycles one by one), so that a subset can be pooled later
        (replayed_on)."""
        return {
            "num_steps": self.num_steps,
            "overall": {str(k): v for k, v in self.overall.items()},
            "per_domain": {d: {str(k): v for k, v in t.items()} for d, t in self.per_domain.items()},
            "settings": self.settings,
            "per_sequence": [{"sequence_id": r.sequence_id, "domain": r.domain,
                              "tokens": {str(k): r.tokens(k) for k in self.num_steps},
                              "cycles": {str(k): r.cycles(k) for k in self.num_steps}} for r in self.sequences],
        }  # fmt: skip


def replay(
    draft: Eagle3Draft,
    seqs: Iterable[ReplaySequence],
    num_steps: Sequence[int] = (1, 2, 3, 4, 5),
    *,
    n_bootstrap: int = 2000,
    seed: int = 0,
    ci_level: float = 0.95,
) -> ReplayResult:
    """Replay every sequence for each num_steps; stats overall and per domain."""
    records = replay_sequences(draft, seqs, num_steps)
    steps = sorted(set(num_steps))

    def table(group: list[SequenceReplay]) -> dict[int, dict[str, Any]]:
        return {k: accept_stats(group, k, n_bootstrap, seed, ci_level) for k in steps}

    domains = sorted({r.domain for r in records})
    return ReplayResult(
        num_steps=steps,
        overall=table(records),
        per_domain={d: table([r for r in records if r.domain == d]) for d in domains},
        sequences=records,
        settings={"n_bootstrap": n_bootstrap, "seed": seed, "ci_level": ci_level,
                  "convention": "tokens per verify (accepted drafts + bonus); first token from prefill"},
    )  # fmt: skip


def replay_run(
    run: RunFolder, draft: Eagle3Draft, num_steps: Sequence[int] = (1, 2, 3, 4, 5), split: str = "eval",
    limit: int | None = None, sequences: Iterable[ReplaySequence] | None = None, **kwargs: Any,
) -> ReplayResult:
    """Replay on a run's committed extract shards (the held-out split by default; the first
    `limit` sequences, in the store's order, when given), or on `sequences` (an online run's,
    tasks.draft.online.online_sequences)."""
    import itertools

    from tasks.extract.storage import iter_extracted

    seqs = sequences if sequences is not None else iter_extracted(run, split)
    result = replay(draft, itertools.islice(seqs, limit), num_steps, **kwargs)
    if not result.sequences:
        where = "training data" if sequences is not None else "extract"
        raise ValueError(f"{run.url}: the {where} has no committed {split!r} sequences to replay")
    return result
