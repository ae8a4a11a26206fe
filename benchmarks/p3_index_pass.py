"""P3, the index pass: what the trainer's set-up reads from one extract shard to index it and
count the draft vocabulary: every sequence decoded with its states (`iter_shard`, what
`build_index` used before) against the tokens alone (`iter_shard_tokens`, now), on the same
shard, with the part's sha256 check beside them. The shard is written by the real ShardWriter in
SmolLM2-135M's layout from random states; the pass runs in this process on one CPU thread.

    .venv/bin/python benchmarks/p3_index_pass.py               # a ~1 GB shard
    .venv/bin/python benchmarks/p3_index_pass.py --gb 0.25     # quicker
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.extract.local_capture import CapturedStates  # noqa: E402
from tasks.extract.sequences import TrainingSequence  # noqa: E402
from tasks.extract.sizes import bytes_per_token  # noqa: E402
from tasks.extract.storage import iter_shard, iter_shard_tokens  # noqa: E402
from tasks.extract.writer import ShardWriter  # noqa: E402

HIDDEN, AUX_IDS, SEQ_TOKENS = 576, [1, 14, 26], 330  # SmolLM2-135M; run 8's mean sequence length
REAL_RUN_GB = 15.724  # run 8's extract/, all parts


def build_shard(gb: float) -> bytearray:
    n = int(gb * 1e9 / (bytes_per_token(HIDDEN, "bf16") * SEQ_TOKENS))
    writer = ShardWriter(HIDDEN, AUX_IDS, "bf16")
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        ids = torch.randint(0, 49152, (SEQ_TOKENS,), generator=g).tolist()
        seq = TrainingSequence(f"r{i}", f"p{i}", "general_chat", "eval" if i % 50 == 0 else "train", ids,
                               [0] * 30 + [1] * (SEQ_TOKENS - 30), False)  # fmt: skip
        states = CapturedStates(torch.randn(SEQ_TOKENS, 3 * HIDDEN, generator=g).bfloat16(),
                                torch.randn(SEQ_TOKENS, HIDDEN, generator=g).bfloat16())  # fmt: skip
        writer.add_many([seq], [states])
    return writer.to_bytes()


def timed_pass(data: bytearray, tokens_only: bool) -> tuple[float, int]:
    """One index pass as build_index makes it with a vocabulary count: lengths, splits, and the
    training sequences' ids and masks kept."""
    counted = []
    began = time.perf_counter()
    for seq in (iter_shard_tokens if tokens_only else iter_shard)(data):
        if seq.split == "train":
            counted.append((seq.input_ids, seq.loss_mask))
        _ = int(seq.input_ids.numel())
    return time.perf_counter() - began, len(counted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="the shard's size")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the node's training process indexes on one thread too
    data = build_shard(args.gb)
    gb = len(data) / 1e9
    began = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    sha_s = time.perf_counter() - began
    states_s, n = timed_pass(data, tokens_only=False)
    tokens_s, n2 = timed_pass(data, tokens_only=True)
    assert n == n2
    out = {"shard_gb": gb, "training_sequences": n, "sha256_s_per_gb": sha_s / gb,
           "with_states_s_per_gb": states_s / gb, "tokens_only_s_per_gb": tokens_s / gb,
           "speedup": states_s / tokens_s}  # fmt: skip
    print(f"shard {gb:.2f} GB, {n} training sequences of {SEQ_TOKENS} tokens (SmolLM2 layout, bf16)")
    print(f"  sha256 of the part (every read):   {sha_s / gb:7.2f} s/GB")
    print(f"  index pass, states decoded:        {states_s / gb:7.2f} s/GB  -> {states_s / gb * REAL_RUN_GB:6.1f} s for run 8's {REAL_RUN_GB} GB")
    print(f"  index pass, tokens only:           {tokens_s / gb:7.2f} s/GB  -> {tokens_s / gb * REAL_RUN_GB:6.1f} s")
    print(f"  tokens only is {states_s / tokens_s:.0f}x faster")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
