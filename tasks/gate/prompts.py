"""The gate's benchmark prompts: the held-out prompt set, picked in a seeded round-robin over its
domains, rendered with the target's tokenizer and chat template."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tasks.gate.plan import GateStopped
from tasks.runfolder import RunFolder

Encoder = Callable[[list[dict[str, Any]]], list[int]]


@dataclass(frozen=True)
class BenchPrompt:
    index: int
    prompt_id: str
    domain: str
    input_ids: tuple[int, ...]


def select_prompts(table: pa.Table, n: int, seed: int, encode: Encoder) -> list[BenchPrompt]:
    """n held-out prompts in a seeded order, domains taken round-robin so a small n covers all.

    The order depends on (seed, prompt_id) only, never on the table's row order."""
    rows = table.select(["prompt_id", "domain", "messages"]).to_pylist()
    if not rows:
        raise GateStopped("the held-out prompt set is empty (discover.holdout_per_domain is 0?)")
    by_domain: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r['prompt_id']}".encode()).digest()):
        by_domain.setdefault(row["domain"], []).append(row)
    picked: list[dict[str, Any]] = []
    queues = [by_domain[d] for d in sorted(by_domain)]
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return [
        BenchPrompt(i, r["prompt_id"], r["domain"], tuple(encode(json.loads(r["messages"]))))
        for i, r in enumerate(picked)
    ]


def load_bench_prompts(run: RunFolder, n: int, seed: int, encode: Encoder) -> list[BenchPrompt]:
    from tasks.discover.commit import read_prompts_table

    return select_prompts(read_prompts_table(run, "holdout"), n, seed, encode)


def encoder_for_target(model_path: str, chat_template: str | None = None) -> Encoder:
    """Prompt ids as generation rendered them: the target's tokenizer and chat template."""
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    tokenizer = load_tokenizer(model_path, chat_template)
    return lambda messages: render_prompt_ids(tokenizer, messages)
