"""The safetensors format, written and read without the extra copies of safetensors.torch.

`safetensors.torch.save` needs whole tensors (a concatenation of a shard's parts: one copy)
and copies them again into its output; `load` copies every tensor out. For a shard of
gigabytes those copies dominated extraction (P3). Here the parts are copied once, straight
into the output buffer, and reading gives views over the buffer. The bytes are standard
safetensors (the tests load them with safetensors itself): an 8-byte little-endian header
size, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}} padded with
spaces to a multiple of 8, then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Iterator
from typing import Any

import torch

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """Bytes that are not a well-formed safetensors object; says what is wrong."""


def _drain(parts: list[torch.Tensor], consume: bool) -> Iterator[torch.Tensor]:
    if not consume:
        yield from parts
        return
    parts.reverse()
    while parts:
        yield parts.pop()


def write_safetensors(
    tensors: dict[str, tuple[list[torch.Tensor], tuple[int, ...], torch.dtype]],
    metadata: dict[str, str],
    consume: bool = False,
) -> bytearray:
    """name -> (CPU parts concatenated along dim 0, full shape, dtype), in the given order.

    `consume` empties the part lists as they are copied, so the parts and the output
    coexist only piece by piece (host memory stays near one output's size)."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, (parts, shape, dtype) in tensors.items():
        nbytes = sum(p.numel() for p in parts) * dtype.itemsize
        expected = dtype.itemsize
        for dim in shape:
            expected *= dim
        if nbytes != expected:
            raise SafetensorsError(
                f"{name}: parts hold {nbytes} bytes, shape {shape} needs {expected}"
            )
        entries[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 8)
    start = 8 + len(header)
    buf = bytearray(start + offset)
    buf[:start] = struct.pack("<Q", len(header)) + header
    out = torch.frombuffer(buf, dtype=torch.uint8)
    pos = start
    for parts, _, dtype in tensors.values():
        for part in _drain(parts, consume):
            if part.dtype != dtype:
                raise SafetensorsError(f"a part of dtype {part.dtype} in a {dtype} tensor")
            raw = part.contiguous().reshape(-1).view(torch.uint8)
            out[pos : pos + raw.numel()].copy_(raw)
            pos += raw.numel()
    return buf


def read_header(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """(header without __metadata__ + "__metadata__" kept, start of the data section)."""
    if len(data) < 8:
        raise SafetensorsError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", bytes(data[:8]))
    if size > MAX_HEADER or 8 + size > len(data):
        raise SafetensorsError(f"header size {size} does not fit {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"unreadable header: {e}") from None
    start, end = 8 + size, 8 + size
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry.get("dtype") not in TORCH_DTYPES:
            raise SafetensorsError(f"{name}: unknown dtype {entry.get('dtype')!r}")
        lo, hi = entry["data_offsets"]
        count = 1
        for dim in entry["shape"]:
            count *= dim
        if hi - lo != count * TORCH_DTYPES[entry["dtype"]].itemsize:
            raise SafetensorsError(f"{name}: {hi - lo} bytes for shape {entry['shape']}")
        spans.append((lo, hi))
    for lo, hi in sorted(spans):
        if start + lo != end:
            raise SafetensorsError("tensor data is not laid out back to back")
        end = start + hi
    if end != len(data):
        raise SafetensorsError(f"tensor data ends at byte {end} of {len(data)}")
    return header, start


def tensor_view(
    data: bytes | bytearray | memoryview, header: dict[str, Any], start: int, name: str
) -> torch.Tensor:
    """A tensor sharing the buffer's memory (read-only when the buffer is `bytes`)."""
    entry = header[name]
    dtype = TORCH_DTYPES[entry["dtype"]]
    lo, hi = entry["data_offsets"]
    if hi == lo:
        return torch.zeros(entry["shape"], dtype=dtype)
    with warnings.catch_warnings():
        # bytes are immutable; callers copy before changing anything.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8, count=hi - lo, offset=start + lo)
    return flat.view(dtype).reshape(entry["shape"])
