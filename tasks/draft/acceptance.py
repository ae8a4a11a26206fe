"""Accept length, counted the way SGLang and vLLM count it: one home for the definition.

A verify cycle emits the drafts the target accepted plus one token of the target's own (the
bonus, or the correction). The accept length of a set of sequences is

    (tokens emitted by verify cycles) / (verify cycles), summed over every sequence first

i.e. pooled by verify count: SGLang's scheduler adds `accepted + batch size` tokens and
`batch size` cycles per verify and logs their ratio (`accept len`); vLLM's mean acceptance
length is 1 + accepted drafts / drafting cycles. A long sequence weighs by its cycles, not as
one ratio among others (a mean of per-sequence ratios is not this number). The first token of
each response comes from prefill, not from a verify cycle, and is left out; SGLang's per-request
`meta_info.spec_accept_length` (completion_tokens / spec_verify_ct) counts it, which is why
stuck acceptance reads (n+1)/n there and exactly 1.0 here.

Users: the gate's request records (tasks.gate.plan.accept_length), its offline replay
(tasks.gate.replay) and the trainer's held-out evaluation (`pooled_accept_len_k`).

Greedy chain (topk 1) on a known sequence: in a maximal run [s, e] of response positions, x_s
comes from prefill and the cycles emit x_{s+1}..x_e. A cycle starting after confirmed token
x_c accepts the leading run of draft matches at index c-1, steps 0..k-1 (matches[j, t]: the
draft's step-j token at index t equals the token at t+2+j), capped by what is left of the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


def pooled_accept_length(tokens: int | float, verifies: int | float) -> float | None:
    """Tokens emitted by verify cycles per verify cycle, both summed over all sequences."""
    return float(tokens) / float(verifies) if verifies > 0 else None


def response_segments(loss_mask: Any) -> list[tuple[int, int]]:
    """Maximal runs [s, e] (inclusive) of True in a 1-D mask, each starting after at least one
    prompt token (a response needs a prompt to follow)."""
    m = np.asarray(loss_mask, dtype=bool).tolist()
    out, start = [], None
    for i, v in enumerate([*m, False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            if start >= 1:
                out.append((start, i - 1))
            start = None
    return out


def leading_runs(matches: Any, k: int) -> np.ndarray:
    """[T] int: at index t, how many of steps 0..k-1 match in a row from step 0 (at most k)."""
    rows = np.asarray(matches, dtype=bool)[:k]
    return np.cumprod(rows, axis=0).sum(axis=0) if len(rows) else np.zeros(rows.shape[1], dtype=np.int64)


def replay_cycles(matches: Any, segments: list[tuple[int, int]], k: int) -> tuple[list[int], list[int]]:
    """(tokens emitted, drafts accepted) per verify cycle with `k` drafts per cycle, in order.
    `matches` is bool [>= k, T] for one sequence."""
    runs = leading_runs(matches, k).tolist()
    emitted: list[int] = []
    accepted: list[int] = []
    for s, e in segments:
        c = s
        while c < e:
            remaining = e - c
            run = min(runs[c - 1], remaining)
            gained = remaining if run >= remaining else run + 1
            emitted.append(gained)
            accepted.append(run)
            c += gained
    return emitted, accepted


def chain_totals(matches: Any, loss_mask: Any, ks: Iterable[int]) -> dict[int, tuple[int, int]]:
    """k -> (tokens emitted, verify cycles) over every row of a batch: `matches` bool [K, B, T],
    `loss_mask` bool [B, T] (padding False). Only the cycles are counted here (every response
    token after a run's first is emitted by exactly one cycle), so this is replay_cycles
    without the per-cycle lists."""
    matches = np.asarray(matches, dtype=bool)
    mask = np.asarray(loss_mask, dtype=bool)
    out: dict[int, tuple[int, int]] = {}
    segments = [response_segments(row) for row in mask]
    tokens = sum(e - s for row in segments for s, e in row)
    for k in ks:
        cycles = 0
        for b, row in enumerate(segments):
            if not row:
                continue
            runs = leading_runs(matches[:, b], k).tolist()
            for s, e in row:
                c = s
                while c < e:
                    c += min(runs[c - 1] + 1, e - c)
                    cycles += 1
        out[k] = (tokens, cycles)
    return out
