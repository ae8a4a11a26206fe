"""Comparing computed figures with committed ones: equal in structure and in every non-float
value, floats within a stated relative tolerance. A committed report is rebuilt on other machines,
whose BLAS may sum in another order and differ in a float's last digits (0.23327008475035504 vs
0.2332700847503551): a different path, not a different result."""

from __future__ import annotations

import math
from typing import Any

# Far below any figure a report prints (3-4 significant digits), far above a BLAS path's ulps.
REL = 1e-9


def figure_differences(got: Any, want: Any, rel: float = REL, where: str = "$") -> list[str]:
    """Where `got` and `want` differ beyond `rel` for floats, exactly for everything else."""
    if isinstance(got, dict) and isinstance(want, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(set(got) ^ set(want))} differ"]
        return [d for k in want for d in figure_differences(got[k], want[k], rel, f"{where}.{k}")]
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items, committed {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in figure_differences(g, w, rel, f"{where}[{i}]")]
    if isinstance(got, float) and isinstance(want, float | int) and not isinstance(want, bool):
        return [] if math.isclose(got, want, rel_tol=rel, abs_tol=0.0) else [f"{where}: {got!r}, committed {want!r}"]
    return [] if got == want and type(got) is type(want) else [f"{where}: {got!r}, committed {want!r}"]


def assert_same_figures(got: Any, want: Any, rel: float = REL) -> None:
    diffs = figure_differences(got, want, rel)
    assert not diffs, f"{len(diffs)} figures differ beyond rel {rel:g}: " + "; ".join(diffs[:5])
