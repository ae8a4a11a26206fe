"""No function in flows/ or tasks/ runs over 80 lines: a longer one is split into named parts
that read top to bottom. Measured from the source (the `def` line to the last line, decorators
aside; a nested function counts in its parent too). And benchmarks/ stays the scripts behind
BENCHMARKS.md, not a second product: under 5,000 lines of Python."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
MAX_BENCHMARK_LINES = 5000


def _function_lengths() -> dict[str, int]:
    """'path::qualified.name' -> lines, for every function and method in flows/ and tasks/."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                lengths[f"{path}::{name}"] = (child.end_lineno or child.lineno) - child.lineno + 1
                name += "."
            elif isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}."
            visit(child, name, path)

    for path in sorted([*(ROOT / "flows").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]):
        rel = str(path.relative_to(ROOT))
        visit(ast.parse(path.read_text(), rel), "", rel)
    return lengths


def test_the_functions_are_read() -> None:
    # The walk must see methods and nested functions, or the check below passes vacuously.
    lengths = _function_lengths()
    assert len(lengths) > 1000
    assert "tasks/generate/shard.py::run_shard" in lengths
    assert "tasks/extract/stage.py::ExtractStage._run_leased" in lengths
    assert "tasks/generate/shard.py::_generate.sink" in lengths


def test_no_function_in_flows_or_tasks_is_over_80_lines() -> None:
    over = {name: n for name, n in _function_lengths().items() if n > MAX_LINES}
    assert over == {}, "split these into named parts that read top to bottom: " + ", ".join(
        f"{name} ({n} lines)" for name, n in sorted(over.items(), key=lambda item: -item[1])
    )


def test_benchmarks_stay_under_5000_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "benchmarks").rglob("*.py")}
    assert len(sizes) > 10 and "load_rehearsal.py" in sizes  # the folder is read
    largest = ", ".join(f"{n} ({k})" for n, k in sorted(sizes.items(), key=lambda item: -item[1])[:5])
    assert sum(sizes.values()) < MAX_BENCHMARK_LINES, f"benchmarks/ grew past {MAX_BENCHMARK_LINES}: {largest}"
