"""Near-copies among prompts, by word 3-grams: MinHash with LSH banding to find candidates among
many, the sets themselves to decide.

A prompt's shingles are the word 3-grams of its user turns' words (NFKC, casefolded, split on
anything not a letter or digit), hashed to 32 bits by CRC-32, as a sorted array; a prompt of
fewer words is one shingle of all of them. Two checks use them:

- `NearDuplicates`: a prompt whose Jaccard similarity with one kept before it reaches the
  threshold is a near duplicate. Candidates come from MinHash signatures (NUM_PERM multiply-shift
  hashes, min over the shingles) split into BANDS bands of ROWS rows: a pair shares a band with
  probability 1 - (1 - J^ROWS)^BANDS (J = 0.8: 0.95; 0.9: 0.9999), then its exact Jaccard decides,
  so nothing is dropped on an estimate. The index is numpy arrays (per band: the band's hash and
  its sort order), not Python objects per prompt: 200,000 prompts take tens of MB, not GB.
- `HeldOutGuard`: strict, for the gate's held-out prompts, and exact: every held-out prompt that
  shares a shingle with a candidate is measured (an inverted index; the held-out set is small), by
  the overlap coefficient |A ∩ B| / min(|A|, |B|), so a held-out prompt inside a longer request,
  or a request inside a held-out prompt, is caught as well as a reworded copy. A miss here would
  train on the benchmark; a sampled estimate could miss. The shared 3-grams must also number at
  least MIN_SHARED (or all of the smaller set): otherwise a request of two 3-grams sharing one
  common phrase ("how to use") with a long held-out prompt scores 0.5 and is dropped, which at
  200,000 prompts took 0.2% of them, most of them short (BENCHMARKS P33).

Deterministic: a fixed seed draws the hash family, and CRC-32 does not depend on the process
(Python's own hash of a string does).
"""

from __future__ import annotations

import unicodedata
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tasks.discover.formats import Messages, user_turns

NGRAM = 3
MIN_SHARED = 3  # shared 3-grams a held-out match needs, unless the smaller set has fewer
NUM_PERM = 128
BANDS, ROWS = 16, 8
_SEED = 0x5EED_2406_0846  # the hash family's seed: fixed, so two runs agree on every candidate
_rng = np.random.default_rng(_SEED)
_A = _rng.integers(1, 2**63, size=NUM_PERM, dtype=np.uint64) | np.uint64(1)  # odd multipliers
_B = _rng.integers(0, 2**63, size=NUM_PERM, dtype=np.uint64)
_BAND_MIX = _rng.integers(1, 2**63, size=ROWS, dtype=np.uint64) | np.uint64(1)  # a band's rows -> one key
_EMPTY = np.zeros(0, dtype=np.uint32)
if BANDS * ROWS != NUM_PERM:
    raise ImportError(f"LSH bands {BANDS} x rows {ROWS} != {NUM_PERM} permutations")


def _words(text: str) -> list[str]:
    folded = unicodedata.normalize("NFKC", text).casefold()
    return "".join(c if c.isalnum() else " " for c in folded).split()


def shingles(messages: Messages) -> np.ndarray:
    """Sorted unique CRC-32 hashes (uint32) of the user turns' word 3-grams (one of all the words
    when fewer)."""
    words = _words("\n".join(m["content"] for m in user_turns(messages)))
    if not words:
        return _EMPTY
    grams = (" ".join(words[i : i + NGRAM]) for i in range(max(1, len(words) - NGRAM + 1)))
    return np.unique(np.fromiter((zlib.crc32(g.encode("utf-8")) for g in grams), dtype=np.uint32))


def signature(shingle_set: np.ndarray) -> np.ndarray:
    """MinHash signature: for each of NUM_PERM hashes h(x) = (a·x + b mod 2^64) >> 32, its minimum
    (uint32; all ones for an empty set)."""
    if not len(shingle_set):
        return np.full(NUM_PERM, 2**32 - 1, dtype=np.uint32)
    x = shingle_set.astype(np.uint64)
    with np.errstate(over="ignore"):  # the hashes are mod 2^64 on purpose
        hashed = (_A[:, None] * x[None, :] + _B[:, None]) >> np.uint64(32)
    return hashed.min(axis=1).astype(np.uint32)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    if not len(a) or not len(b):
        return 0.0
    shared = len(np.intersect1d(a, b, assume_unique=True))
    return shared / (len(a) + len(b) - shared)


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """|A ∩ B| / min(|A|, |B|): 1.0 when one holds the other; 0.0 when they share fewer than
    MIN_SHARED 3-grams and the smaller set has more than that (one common phrase is no copy)."""
    if not len(a) or not len(b):
        return 0.0
    shared, smaller = len(np.intersect1d(a, b, assume_unique=True)), min(len(a), len(b))
    return shared / smaller if shared >= min(MIN_SHARED, smaller) else 0.0


@dataclass(frozen=True)
class Match:
    key: str  # the prompt it is near to
    similarity: float


class NearDuplicates:
    """Prompts in the order they are decided (the ones kept unconditionally first); `match(i)`
    finds the nearest prompt before `i` that was kept (`keep`), at or above the Jaccard threshold."""

    def __init__(self, keys: Sequence[str], shingle_sets: Sequence[np.ndarray], threshold: float) -> None:
        self.keys, self.sets, self.threshold = list(keys), list(shingle_sets), threshold
        n = len(self.sets)
        sigs = np.stack([signature(s) for s in self.sets]) if n else np.zeros((0, NUM_PERM), np.uint32)
        bands = np.empty((n, BANDS), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for b in range(BANDS):  # a band at a time: the 64-bit products of all bands at once were ~7x the index
                bands[:, b] = (sigs[:, b * ROWS : (b + 1) * ROWS].astype(np.uint64) * _BAND_MIX).sum(axis=1)
        self._order = np.argsort(bands, axis=0, kind="stable")  # per band: positions by key
        self._sorted = np.take_along_axis(bands, self._order, axis=0)
        self._bands = bands
        self.kept = np.zeros(n, dtype=bool)

    def keep(self, i: int) -> None:
        if len(self.sets[i]):  # an empty set is near nothing
            self.kept[i] = True

    def match(self, i: int) -> Match | None:
        if not len(self.sets[i]):
            return None
        candidates: set[int] = set()
        for b in range(BANDS):
            column, key = self._sorted[:, b], self._bands[i, b]
            lo, hi = np.searchsorted(column, key, side="left"), np.searchsorted(column, key, side="right")
            same = self._order[lo:hi, b]
            candidates.update(int(j) for j in same[(same < i) & self.kept[same]])
        best: Match | None = None
        for j in sorted(candidates):  # sorted: ties go to the same prompt every run
            similarity = jaccard(self.sets[i], self.sets[j])
            if similarity >= self.threshold and (best is None or similarity > best.similarity):
                best = Match(self.keys[j], similarity)
        return best


class HeldOutGuard:
    """The held-out prompts' shingles, indexed by shingle; `match` measures every held-out prompt
    that shares one with a candidate, exactly."""

    def __init__(self, held_out: Iterable[tuple[str, Messages]], threshold: float) -> None:
        self.threshold = threshold
        self._sets: dict[str, np.ndarray] = {}
        self._by_shingle: dict[int, list[str]] = {}
        for key, messages in held_out:
            s = shingles(messages)
            self._sets[key] = s
            for h in s.tolist():
                self._by_shingle.setdefault(h, []).append(key)
        self._all = np.array(sorted(self._by_shingle), dtype=np.uint32)

    def match(self, shingle_set: np.ndarray) -> Match | None:
        shared = shingle_set[np.isin(shingle_set, self._all, assume_unique=True)]  # most share none
        if not len(shared):
            return None
        near = {key for h in shared.tolist() for key in self._by_shingle[h]}
        best: Match | None = None
        for key in sorted(near):
            similarity = overlap(shingle_set, self._sets[key])
            if similarity >= self.threshold and (best is None or similarity > best.similarity):
                best = Match(key, similarity)
        return best
