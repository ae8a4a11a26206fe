"""Extracted hidden states: safetensors objects, sequences back to back. A committed extract
shard is one or more such objects (parts, in order, listed by its marker; each part is
self-contained: the tensors and metadata of its own sequences).

Tensors (T tokens over N sequences, H = target hidden size):
    input_ids int32 [T], loss_mask uint8 [T], seq_offsets int64 [N + 1]
    aux_hidden [T, 3H] and last_hidden [T, H]: bf16, or float8_e4m3fn with
    aux_scale float32 [T, 3] and last_scale float32 [T, 1] (one scale per token per layer)
Metadata (strings): format_version, storage_dtype, hidden_size, aux_layer_ids, sequence_ids,
domains, splits (JSON lists).

This module is the reader API (H5/H7 call it) and re-exports the writer (`writer`).
Reading works on views of the shard's bytes: states are copied (dequantized to float32)
one sequence at a time, when yielded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tasks.extract.safetensors_io import SafetensorsError, read_header, tensor_view
from tasks.extract.writer import (
    AUX_LAYERS,
    FORMAT_VERSION,
    STORAGE_DTYPES,
    ShardWriter,
    bytes_per_token,
    dequantize_fp8,
    quantize_fp8,
)

if TYPE_CHECKING:
    from tasks.runfolder import RunFolder

__all__ = [
    "AUX_LAYERS",
    "FORMAT_VERSION",
    "STAGE",
    "STORAGE_DTYPES",
    "ExtractFormatError",
    "ExtractedSequence",
    "ShardWriter",
    "bytes_per_token",
    "decode_extract_shard",
    "dequantize_fp8",
    "extract_metadata",
    "iter_extracted",
    "iter_shard",
    "quantize_fp8",
    "shard_metadata",
    "verify_shard",
]

Buffer = bytes | bytearray | memoryview
STAGE = "extract"
_META_KEYS = (
    "format_version",
    "storage_dtype",
    "hidden_size",
    "aux_layer_ids",
    "sequence_ids",
    "domains",
    "splits",
)


class ExtractFormatError(ValueError):
    """An extract shard that does not follow the format; says which field is wrong."""


@dataclass
class SequenceTokens:
    """A sequence without its states: what indexing and the vocabulary count read."""

    sequence_id: str
    domain: str
    split: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]


@dataclass
class ExtractedSequence(SequenceTokens):
    aux_hidden: torch.Tensor  # float32 [T, 3H], dequantized
    last_hidden: torch.Tensor  # float32 [T, H]


def _header(data: Buffer) -> tuple[dict[str, Any], int]:
    try:
        return read_header(data)
    except SafetensorsError as e:
        raise ExtractFormatError(f"extract shard: {e}") from None


def shard_metadata(data: Buffer) -> dict[str, Any]:
    """The shard's metadata, parsed (lists and ints), from the header alone."""
    meta = _header(data)[0].get("__metadata__") or {}
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ExtractFormatError(f"extract shard: metadata lacks {missing}")
    if meta["format_version"] != FORMAT_VERSION:
        raise ExtractFormatError(
            f"extract shard: format_version {meta['format_version']!r}, expected {FORMAT_VERSION!r}"
        )
    if meta["storage_dtype"] not in STORAGE_DTYPES:
        raise ExtractFormatError(f"extract shard: storage_dtype {meta['storage_dtype']!r} unknown")
    parsed = {
        k: json.loads(meta[k]) for k in ("aux_layer_ids", "sequence_ids", "domains", "splits")
    }
    return {
        "format_version": meta["format_version"],
        "storage_dtype": meta["storage_dtype"],
        "hidden_size": int(meta["hidden_size"]),
        **parsed,
    }


def _checked_tensors(data: Buffer, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Views of every tensor over `data`, after checking names, dtypes, shapes and offsets."""
    header, start = _header(data)
    n, h = len(meta["sequence_ids"]), meta["hidden_size"]
    if not len(meta["domains"]) == len(meta["splits"]) == n:
        raise ExtractFormatError("extract shard: sequence_ids, domains and splits differ in length")
    fp8 = meta["storage_dtype"] == "fp8_e4m3"
    hidden = "F8_E4M3" if fp8 else "BF16"
    names = {k for k in header if k != "__metadata__"}
    expected = {"input_ids", "loss_mask", "seq_offsets", "aux_hidden", "last_hidden"}
    expected |= {"aux_scale", "last_scale"} if fp8 else set()
    if names != expected:
        raise ExtractFormatError(
            f"extract shard: tensors {sorted(names)}, expected {sorted(expected)}"
        )
    total = header["input_ids"]["shape"][0] if header["input_ids"]["shape"] else -1
    specs = {
        "input_ids": ("I32", [total]),
        "seq_offsets": ("I64", [n + 1]),
        "loss_mask": ("U8", [total]),
        "aux_hidden": (hidden, [total, AUX_LAYERS * h]),
        "last_hidden": (hidden, [total, h]),
        **(
            {"aux_scale": ("F32", [total, AUX_LAYERS]), "last_scale": ("F32", [total, 1])}
            if fp8
            else {}
        ),
    }
    for name, (dtype, shape) in specs.items():
        got = (header[name]["dtype"], header[name]["shape"])
        if got != (dtype, shape):
            raise ExtractFormatError(
                f"extract shard: {name} is {got[0]} {got[1]}, expected {dtype} {shape}"
            )
    t = {name: tensor_view(data, header, start, name) for name in expected}
    offsets = t["seq_offsets"]
    if (
        int(offsets[0]) != 0
        or int(offsets[-1]) != total
        or bool((offsets[1:] < offsets[:-1]).any())
    ):
        raise ExtractFormatError("extract shard: seq_offsets do not partition the tokens")
    return t


def iter_shard(data: Buffer) -> Iterator[ExtractedSequence]:
    """The shard's sequences one at a time, each dequantized to float32 only when yielded."""
    meta = shard_metadata(data)
    t = _checked_tensors(data, meta)
    fp8 = meta["storage_dtype"] == "fp8_e4m3"
    offsets = t["seq_offsets"].tolist()
    for i, sequence_id in enumerate(meta["sequence_ids"]):
        lo, hi = offsets[i], offsets[i + 1]
        aux, last = t["aux_hidden"][lo:hi], t["last_hidden"][lo:hi]
        yield ExtractedSequence(
            sequence_id=sequence_id,
            domain=meta["domains"][i],
            split=meta["splits"][i],
            input_ids=t["input_ids"][lo:hi].long(),
            loss_mask=t["loss_mask"][lo:hi].bool(),
            aux_hidden=dequantize_fp8(aux, t["aux_scale"][lo:hi]) if fp8 else aux.float(),
            last_hidden=dequantize_fp8(last, t["last_scale"][lo:hi]) if fp8 else last.float(),
        )


def iter_shard_tokens(data: Buffer) -> Iterator[SequenceTokens]:
    """The shard's sequences without their states, which are neither copied nor dequantized:
    indexing and the vocabulary count need the tokens only (decoding SmolLM2's states costs
    70x as much, benchmarks/p3_index_pass.py)."""
    meta = shard_metadata(data)
    t = _checked_tensors(data, meta)
    offsets = t["seq_offsets"].tolist()
    ids, mask = t["input_ids"].long(), t["loss_mask"].bool()
    for i, sequence_id in enumerate(meta["sequence_ids"]):
        lo, hi = offsets[i], offsets[i + 1]
        yield SequenceTokens(sequence_id, meta["domains"][i], meta["splits"][i], ids[lo:hi], mask[lo:hi])


def verify_shard(data: Buffer) -> list[str]:
    """The shard's sequence ids, after checking the layout of every tensor (header and
    offsets, no copy of the states) and that each sequence has loss tokens."""
    meta = shard_metadata(data)
    t = _checked_tensors(data, meta)
    offsets = t["seq_offsets"]
    per_seq = torch.zeros(len(meta["sequence_ids"]), dtype=torch.int64)
    if len(per_seq):
        owner = torch.repeat_interleave(torch.arange(len(per_seq)), offsets[1:] - offsets[:-1])
        per_seq.index_add_(0, owner, t["loss_mask"].long())
    empty = [meta["sequence_ids"][i] for i in (per_seq == 0).nonzero().flatten().tolist()]
    if empty:
        raise ExtractFormatError(f"extract shard: sequences {empty[:3]} have no loss tokens")
    return meta["sequence_ids"]


def decode_extract_shard(data: Buffer) -> list[ExtractedSequence]:
    return list(iter_shard(data))


def iter_extracted(run: RunFolder, split: str | None = None) -> Iterator[ExtractedSequence]:
    """Committed extract shards in shard-id order, their parts in order (sha-verified),
    optionally one split only."""
    from tasks.runfolder import ShardStore

    store = ShardStore(run, STAGE)
    committed = store.committed()
    for shard_id in sorted(committed):
        # One part in memory at a time, each read and sha-verified when reached.
        for data in store.iter_parts(committed[shard_id]):
            for seq in iter_shard(data):
                if split is None or seq.split == split:
                    yield seq


def extract_metadata(run: RunFolder) -> dict[str, Any]:
    """hidden_size, aux_layer_ids, storage_dtype and counts over the committed extract shards."""
    from tasks.runfolder import ShardStore

    store = ShardStore(run, STAGE)
    markers = store.committed()
    if not markers:
        raise FileNotFoundError(f"{run.url}/{STAGE} has no committed shards: run the extract stage")
    layouts = {
        (m["hidden_size"], tuple(m["aux_layer_ids"]), m["storage_dtype"]) for m in markers.values()
    }
    if len(layouts) != 1:
        raise ExtractFormatError(
            f"{run.url}/{STAGE}: shards disagree on (hidden_size, aux_layer_ids, storage_dtype): "
            f"{sorted(layouts)}"
        )
    hidden_size, aux_ids, storage_dtype = layouts.pop()
    holdouts = {m.get("holdout") for m in markers.values()}  # one: the stage refuses to mix them
    splits = {"train": 0, "eval": 0}
    for m in markers.values():
        for name, count in m.get("splits", {}).items():
            splits[name] = splits.get(name, 0) + count
    return {
        "hidden_size": hidden_size,
        "aux_layer_ids": list(aux_ids),
        "storage_dtype": storage_dtype,
        "shards": len(markers),
        "sequences": sum(m["rows"] for m in markers.values()),
        "tokens": sum(m.get("tokens", 0) for m in markers.values()),
        "loss_tokens": sum(m.get("loss_tokens", 0) for m in markers.values()),
        "truncated": sum(m.get("truncated", 0) for m in markers.values()),
        "splits": splits,
        "holdout": holdouts.pop() if len(holdouts) == 1 else None,  # None: a shard from before the key
        "complete": store.is_complete(),
    }
