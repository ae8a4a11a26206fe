"""P3: extraction throughput of the local capture on one GPU, against the forward pass alone.

A random-weight target of Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads / 8 KV heads,
intermediate 8192, vocab 128256), built on the device from a config (no hub), bf16, SDPA.
The same random sequences (lengths uniform in [min_len, max_len]) go through the same padded
batches in every mode, in the extract stage's grouping (chunks of 8 batches, longest first):

    forward   the decoder's forward alone (no hooks, no lm_head, states discarded)
    capture   + hooks on the aux layers, concatenation and per-sequence slicing
    bf16      + the stage's storage path: encode, copy to host, serialize the safetensors
    fp8       shard, decode it back to verify (tasks.extract.storage.verify_shard)

Tokens are real tokens (padding excluded). Bytes/token is the serialized shard's size over its
tokens. Each mode runs `--repeats` times after one warm-up chunk; the best time is reported.

    python3 benchmarks/p3_extract.py                 # on the H200
    .venv/bin/python benchmarks/p3_extract.py --tiny # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.extract.capture import aux_capture_layers
from tasks.extract.local_capture import LocalCapture
from tasks.extract.storage import ShardWriter, verify_shard

LLAMA_32_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=8192, vocab_size=128256, head_dim=64, max_position_embeddings=8192,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)  # fmt: skip
TINY = dict(LLAMA_32_1B, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=2048, head_dim=16)  # fmt: skip
CHUNK_BATCHES = 8  # as tasks.extract.stage.CAPTURE_CHUNK_BATCHES


@dataclass
class TrainingSequence:
    """The fields ShardWriter reads of tasks.extract.sequences.TrainingSequence; that module
    pulls in the config layer (pydantic), which the GPU image lacks."""

    sequence_id: str
    prompt_id: str
    domain: str
    split: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def build_model(shape: dict, device: str) -> LlamaForCausalLM:
    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def make_sequences(n: int, lo: int, hi: int, vocab: int) -> list[TrainingSequence]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        half = length // 2
        out.append(TrainingSequence(f"s{i:05d}", f"p{i}", "bench", "train", ids, [0] * half + [1] * (length - half), False))
    return out


def chunks(seqs: list[TrainingSequence], batch_size: int) -> list[list[TrainingSequence]]:
    size = batch_size * CHUNK_BATCHES
    return [seqs[i : i + size] for i in range(0, len(seqs), size)]


def padded_tokens(parts: list[list[TrainingSequence]], batch_size: int) -> int:
    total = 0
    for part in parts:
        lengths = sorted((len(s.input_ids) for s in part), reverse=True)
        for i in range(0, len(lengths), batch_size):
            total += lengths[i] * len(lengths[i : i + batch_size])
    return total


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_forward(cap: LocalCapture, part: list[TrainingSequence]) -> None:
    """The same batches LocalCapture.capture builds, through the decoder without hooks."""
    ordered = sorted((s.input_ids for s in part), key=len, reverse=True)
    with torch.inference_mode():
        for start in range(0, len(ordered), cap.batch_size):
            batch = ordered[start : start + cap.batch_size]
            width = max(len(s) for s in batch)
            ids = torch.full((len(batch), width), cap.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, seq in enumerate(batch):
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            cap.base(input_ids=ids.to(cap.device), attention_mask=mask.to(cap.device), use_cache=False)


def run_capture(cap: LocalCapture, part: list[TrainingSequence]) -> None:
    cap.capture([s.input_ids for s in part])


def pipeline(storage_dtype: str, result: dict) -> Callable[[LocalCapture, list[list[TrainingSequence]]], None]:
    def run(cap: LocalCapture, parts: list[list[TrainingSequence]]) -> None:
        writer = ShardWriter(cap.hidden_size, cap.aux_layer_ids, storage_dtype)
        start = time.perf_counter()
        for part in parts:
            writer.add_many(part, cap.capture([s.input_ids for s in part]))
        encoded = time.perf_counter()
        data = writer.to_bytes()
        serialized = time.perf_counter()
        verify_shard(data)
        done = time.perf_counter()
        result.update(bytes=len(data), error=writer.error_report(),
                      split_s={"capture+encode+to_host": encoded - start, "serialize": serialized - encoded,
                               "verify": done - serialized})  # fmt: skip

    return run


def timed(fn: Callable[[], None], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=192)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny model")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else LLAMA_32_1B
    model = build_model(shape, device)
    ids = aux_capture_layers("llama", shape["num_hidden_layers"])
    cap = LocalCapture(model, ids, batch_size=args.batch_size)
    seqs = make_sequences(args.seqs, args.min_len, args.max_len, shape["vocab_size"])
    parts = chunks(seqs, args.batch_size)
    tokens = sum(len(s.input_ids) for s in seqs)
    padded = padded_tokens(parts, args.batch_size)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}")
    print(f"model {json.dumps(shape)}; aux layers {ids}; dtype {next(model.parameters()).dtype}")
    print(f"{len(seqs)} sequences, {tokens:,} tokens ({padded:,} with padding), batch {args.batch_size}")

    results: dict[str, dict] = {name: {} for name in ("bf16", "fp8_e4m3")}
    modes: dict[str, Callable[[], None]] = {
        "forward": lambda: [run_forward(cap, p) for p in parts],
        "capture": lambda: [run_capture(cap, p) for p in parts],
        "capture+bf16": lambda: pipeline("bf16", results["bf16"])(cap, parts),
        "capture+fp8": lambda: pipeline("fp8_e4m3", results["fp8_e4m3"])(cap, parts),
    }
    run_forward(cap, parts[0][: args.batch_size])
    run_capture(cap, parts[0][: args.batch_size])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    figures = {}
    for name, fn in modes.items():
        times = [timed(fn, device) for _ in range(args.repeats)]
        figures[name] = {"seconds": min(times), "all_seconds": times, "tokens_per_s": tokens / min(times)}
    base = figures["forward"]["tokens_per_s"]
    print(f"\n{'mode':<14}{'best s':>9}{'tok/s':>13}{'vs forward':>12}{'bytes/token':>13}{'rel RMS aux':>13}")
    for name, f in figures.items():
        store = results.get(name.split("+")[-1].replace("fp8", "fp8_e4m3")) if "+" in name else None
        bpt = f"{store['bytes'] / tokens:,.0f}" if store else "-"
        err = f"{store['error']['aux']['rel_rms']:.2e}" if store else "-"
        f.update(bytes_per_token=store["bytes"] / tokens if store else None, error=store["error"] if store else None,
                 split_s=store["split_s"] if store else None)  # fmt: skip
        print(f"{name:<14}{f['seconds']:>9.2f}{f['tokens_per_s']:>13,.0f}{f['tokens_per_s'] / base:>12.2f}{bpt:>13}{err:>13}")
    for name in ("capture+bf16", "capture+fp8"):
        parts_s = ", ".join(f"{k} {v:.2f} s" for k, v in figures[name]["split_s"].items())
        print(f"{name} (last run): {parts_s}")
    if device == "cuda":
        print(f"\npeak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": tokens, "padded_tokens": padded, "shape": shape, "aux_layer_ids": ids, "figures": figures},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
