"""What extracted hidden states take on disk, without torch: the storage dtypes, the bytes a
token costs, decimal byte counts for people, and the free space where a local folder would be.
The writer encodes to these sizes, the forecast at extraction's start and `eaglescale run
--dry-run` (which must start nothing heavy) both count with them."""

from __future__ import annotations

import shutil
from pathlib import Path

STORAGE_DTYPES = ("bf16", "fp8_e4m3")
AUX_LAYERS = 3
_UNITS = ("B", "kB", "MB", "GB", "TB", "PB", "EB")


def bytes_per_token(hidden_size: int, storage_dtype: str) -> int:
    """Stored bytes per token: hidden states (+ fp8 scales) + int32 id + uint8 mask."""
    if storage_dtype == "bf16":
        states = (AUX_LAYERS + 1) * hidden_size * 2
    elif storage_dtype == "fp8_e4m3":
        states = (AUX_LAYERS + 1) * hidden_size + (AUX_LAYERS + 1) * 4
    else:
        raise ValueError(f"storage_dtype must be one of {STORAGE_DTYPES}, got {storage_dtype!r}")
    return states + 4 + 1


def human_bytes(n: float) -> str:
    """Decimal units, as disks are sold: 57344 -> '57.3 kB'."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1000 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def free_bytes_at(path: Path) -> tuple[int, Path]:
    """(free bytes, the folder measured): the nearest existing folder at or above `path`, where
    a folder not made yet would be."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free, path
