"""Encoding a shard's hidden states for storage: bf16, or fp8 e4m3 with per-token scales.

fp8: each token's values of one layer are scaled so their amax maps to e4m3's largest finite
value 448, so every value keeps e4m3's 3-bit mantissa relative precision: the rounding error
is at most half a step of the top binade, amax·16/448 = amax/28, per element (values under
amax·2⁻¹⁵ fall into e4m3's subnormals and keep that same absolute bound). The layout and the
reader are in `storage`.

A shard is written as parts of about `part_bytes` each (whole sequences, in order), each a
self-contained object in that layout, so host memory holds about one part, never the shard.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tasks.extract.safetensors_io import write_safetensors
from tasks.extract.sizes import AUX_LAYERS, STORAGE_DTYPES, bytes_per_token

if TYPE_CHECKING:
    from tasks.extract.local_capture import CapturedStates
    from tasks.extract.sequences import TrainingSequence

FORMAT_VERSION = "1"
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, groups·H] -> (float8_e4m3fn [T, groups·H], float32 scales [T, groups])."""
    rows = x.shape[0]
    grouped = x.float().reshape(rows, groups, -1)
    amax = grouped.abs().amax(dim=-1)
    # An all-zero group keeps scale 1 (any scale reproduces zeros exactly).
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (grouped / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, groups = scale.shape
    return (q.float().reshape(rows, groups, -1) * scale[..., None]).reshape(rows, -1)


def storage_round_trip(x: torch.Tensor, storage_dtype: str, groups: int) -> torch.Tensor:
    """`x` [T, groups·H] as a reader gets it back from storage in `storage_dtype` (float32).
    Online training feeds the draft these values, so the two modes train on the same numbers."""
    if storage_dtype == "bf16":
        return x.to(torch.bfloat16).float()
    if storage_dtype == "fp8_e4m3":
        return dequantize_fp8(*quantize_fp8(x, groups))
    raise ValueError(f"storage_dtype must be one of {STORAGE_DTYPES}, got {storage_dtype!r}")


class _ErrorStats:
    """Running max-abs and relative-RMS error of a stored tensor against its capture.

    Accumulates on the tensors' device: no host sync per sequence on a GPU.
    """

    def __init__(self) -> None:
        self._max_abs: torch.Tensor | None = None
        self._err_sq: torch.Tensor | None = None
        self._ref_sq: torch.Tensor | None = None

    def add(self, reference: torch.Tensor, stored: torch.Tensor) -> None:
        ref = reference.float()
        err = stored.float() - ref
        if not err.numel():
            return
        stats = (
            err.abs().amax(),
            err.pow(2).sum(dtype=torch.float64),
            ref.pow(2).sum(dtype=torch.float64),
        )
        if self._max_abs is None:
            self._max_abs, self._err_sq, self._ref_sq = stats
            return
        self._max_abs = torch.maximum(self._max_abs, stats[0])
        self._err_sq = self._err_sq + stats[1]
        self._ref_sq = self._ref_sq + stats[2]

    def report(self) -> dict[str, float]:
        if self._max_abs is None:
            return {"max_abs": 0.0, "rel_rms": 0.0}
        ref_sq = float(self._ref_sq)
        rel = math.sqrt(float(self._err_sq) / ref_sq) if ref_sq > 0 else 0.0
        return {"max_abs": float(self._max_abs), "rel_rms": rel}


class ShardWriter:
    """Collects a shard's sequences and states, encodes them on the states' device (one encode
    and one host copy per group of sequences), and serializes them with a single copy into
    the output; keeps the reconstruction error of everything it stored.

    With `part_bytes`, sequences go into parts: when the next sequence would take the
    buffered part past `part_bytes` (tensor bytes), the part is serialized and handed to
    `on_part` and the buffers are released; `flush()` hands over the last one. A sequence
    larger than `part_bytes` is a part of its own. Part boundaries depend only on the
    sequence lengths, not on how the sequences were grouped into `add_many` calls.
    Without `part_bytes`, `to_bytes()` serializes everything added.
    """

    def __init__(
        self,
        hidden_size: int,
        aux_layer_ids: list[int],
        storage_dtype: str = "bf16",
        part_bytes: int | None = None,
        on_part: Callable[[bytearray], None] | None = None,
    ):
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"storage_dtype must be one of {STORAGE_DTYPES}, got {storage_dtype!r}"
            )
        if len(aux_layer_ids) != AUX_LAYERS:
            raise ValueError(f"expected {AUX_LAYERS} aux layer ids, got {aux_layer_ids}")
        if part_bytes is not None and (part_bytes < 1 or on_part is None):
            raise ValueError(
                f"part_bytes={part_bytes} needs to be >= 1 and come with an on_part callback"
            )
        self.hidden_size = hidden_size
        self.aux_layer_ids = list(aux_layer_ids)
        self.storage_dtype = storage_dtype
        self.part_bytes, self.on_part = part_bytes, on_part
        self._token_bytes = bytes_per_token(hidden_size, storage_dtype)
        self._errors = {"aux": _ErrorStats(), "last": _ErrorStats()}
        self.parts_written = 0
        self._reset()

    def _reset(self) -> None:
        self._meta: list[tuple[str, str, str]] = []
        self._parts: dict[str, list[torch.Tensor]] = {name: [] for name in self._layout()}
        self._lengths: list[int] = []
        self._tokens = 0

    def _layout(self) -> dict[str, tuple[torch.dtype, int | None]]:
        """name -> (dtype, width or None for 1-D); widest elements first keeps them aligned."""
        hidden = torch.float8_e4m3fn if self.storage_dtype == "fp8_e4m3" else torch.bfloat16
        layout: dict[str, tuple[torch.dtype, int | None]] = {"seq_offsets": (torch.int64, None)}
        if self.storage_dtype == "fp8_e4m3":
            layout |= {"aux_scale": (torch.float32, AUX_LAYERS), "last_scale": (torch.float32, 1)}
        return layout | {
            "input_ids": (torch.int32, None),
            "aux_hidden": (hidden, AUX_LAYERS * self.hidden_size),
            "last_hidden": (hidden, self.hidden_size),
            "loss_mask": (torch.uint8, None),
        }

    @property
    def buffered_bytes(self) -> int:
        """Tensor bytes of the sequences not yet handed over (seq_offsets included)."""
        return self._tokens * self._token_bytes + 8 * (len(self._lengths) + 1)

    def _store(self, name: str, x: torch.Tensor, groups: int) -> None:
        if self.storage_dtype == "bf16":
            stored = x.to(torch.bfloat16)
            if x.dtype != torch.bfloat16:  # a bf16 model's states are stored exactly
                self._errors[name].add(x, stored)
            self._parts[f"{name}_hidden"].append(stored.cpu())
            return
        q, scale = quantize_fp8(x, groups)
        self._errors[name].add(x, dequantize_fp8(q, scale))
        self._parts[f"{name}_hidden"].append(q.cpu())
        self._parts[f"{name}_scale"].append(scale.cpu())

    def _encode(self, seqs: list[TrainingSequence], states: list[CapturedStates]) -> None:
        if not seqs:
            return
        self._meta += [(s.sequence_id, s.domain, s.split) for s in seqs]
        self._lengths += [len(s.input_ids) for s in seqs]
        self._tokens += sum(len(s.input_ids) for s in seqs)
        self._parts["input_ids"].append(
            torch.tensor([t for s in seqs for t in s.input_ids], dtype=torch.int32)
        )
        self._parts["loss_mask"].append(
            torch.tensor([m for s in seqs for m in s.loss_mask], dtype=torch.uint8)
        )
        self._store("aux", torch.cat([st.aux for st in states]), AUX_LAYERS)
        self._store("last", torch.cat([st.last for st in states]), 1)

    def add_many(self, seqs: list[TrainingSequence], states: list[CapturedStates]) -> None:
        h = self.hidden_size
        for seq, st in zip(seqs, states, strict=True):
            n = len(seq.input_ids)
            if tuple(st.aux.shape) != (n, AUX_LAYERS * h) or tuple(st.last.shape) != (n, h):
                raise ValueError(
                    f"sequence {seq.sequence_id}: states aux {tuple(st.aux.shape)} / last "
                    f"{tuple(st.last.shape)} do not fit {n} tokens of hidden size {h} "
                    f"(expected ({n}, {AUX_LAYERS * h}) / ({n}, {h}))"
                )
        if self.part_bytes is None:
            self._encode(seqs, states)
            return
        start, group_tokens = 0, 0
        for i, seq in enumerate(seqs):
            n = len(seq.input_ids)
            held = len(self._lengths) + (i - start)
            size = self.buffered_bytes + (group_tokens + n) * self._token_bytes + 8 * (i - start + 1)
            if held and size > self.part_bytes:
                self._encode(seqs[start:i], states[start:i])
                self.flush()
                start, group_tokens = i, 0
            group_tokens += n
        self._encode(seqs[start:], states[start:])
        if self.buffered_bytes >= self.part_bytes:
            self.flush()

    def add(self, seq: TrainingSequence, states: CapturedStates) -> None:
        self.add_many([seq], [states])

    def flush(self) -> None:
        """Hand the buffered sequences to `on_part` as one part (nothing when none are)."""
        if not self._lengths:
            return
        if self.on_part is None:
            raise ValueError("flush() needs an on_part callback; use to_bytes() without parts")
        data = self._serialize(consume=True)
        self._reset()
        self.parts_written += 1
        self.on_part(data)

    def error_report(self) -> dict[str, dict[str, float]]:
        return {name: stats.report() for name, stats in self._errors.items()}

    def to_bytes(self) -> bytearray:
        """Everything buffered, serialized (the buffers are kept)."""
        return self._serialize(consume=False)

    def _serialize(self, consume: bool) -> bytearray:
        offsets = torch.zeros(len(self._lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(self._lengths, dtype=torch.int64).cumsum(0)
        self._parts["seq_offsets"] = [offsets]
        rows = {name: self._tokens for name in self._parts}
        rows["seq_offsets"] = len(offsets)
        tensors = {
            name: (self._parts[name], (rows[name], width) if width else (rows[name],), dtype)
            for name, (dtype, width) in self._layout().items()
        }
        ids, domains, splits = (
            (list(col) for col in zip(*self._meta, strict=True)) if self._meta else ([], [], [])
        )
        metadata = {
            "format_version": FORMAT_VERSION,
            "storage_dtype": self.storage_dtype,
            "hidden_size": str(self.hidden_size),
            "aux_layer_ids": json.dumps(self.aux_layer_ids),
            "sequence_ids": json.dumps(ids),
            "domains": json.dumps(domains),
            "splits": json.dumps(splits),
        }
        return write_safetensors(tensors, metadata, consume=consume)
