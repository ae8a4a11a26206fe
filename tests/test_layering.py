"""The import arrows point down: the layers docs/DESIGN.md names import nothing of those above
them. Read from the source (every import, at module level or inside a function: a lazy import
is an arrow too), so a new upward import fails here rather than in a circular-import error."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in [*(ROOT / "tasks").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]:
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        graph[_module(path)] = {n for n in names if n.split(".")[0] in ("tasks", "flows")}
    return graph


GRAPH = _imports()


def _closure(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        if m not in seen and m in GRAPH:
            seen.add(m)
            todo.extend(GRAPH[m])
    return seen


def _outside(prefix: str, allowed: tuple[str, ...] = ()) -> dict[str, list[str]]:
    return {
        m: sorted(i for i in deps if not i.startswith((prefix, *allowed)))
        for m, deps in GRAPH.items()
        if m.startswith(prefix) and any(not i.startswith((prefix, *allowed)) for i in deps)
    }


def test_the_graph_is_read() -> None:
    # The reader must see real arrows, or every check below passes vacuously.
    assert len(GRAPH) > 100
    assert "tasks.sglang.versions" in GRAPH["tasks.sglang.command"]
    assert any(d.startswith("tasks.runfolder") for d in GRAPH["tasks.generate.stage"])


def test_tasks_never_import_flows() -> None:
    assert {m: d for m, d in GRAPH.items() if m.startswith("tasks") and any(i.startswith("flows") for i in d)} == {}


def test_the_run_folder_and_sglang_knowledge_stand_alone() -> None:
    assert _outside("tasks.runfolder") == {}
    assert _outside("tasks.sglang.") == {}


def test_engines_hold_engines_and_the_stand_ins_sit_beside_them() -> None:
    # Capture belongs to extraction, the local speculative engine to the gate, the SGLang
    # stand-ins to their own package: the engines import none of them (nor the draft).
    upward = ("tasks.draft", "tasks.extract", "tasks.gate", "tasks.standins", "tasks.generate")
    assert {m: d for m, d in GRAPH.items() if m.startswith("tasks.engines") and any(i.startswith(upward) for i in d)} == {}
    assert _outside("tasks.standins", ("tasks.engines", "tasks.sglang.")) == {}
    # The real client reads SGLang's answers without the stand-ins' types.
    assert not any(i.startswith("tasks.standins") for i in _closure("tasks.engines.sglang_client"))


def test_loading_a_config_imports_no_stage_code() -> None:
    # tasks/config.py -> tasks/gate/config.py once reached the launch builder for one validator.
    reached = _closure("tasks.config")
    assert "tasks.gate.config" in reached and "tasks.sglang.versions" in reached
    stage_code = sorted(m for m in reached if m.startswith(("tasks.gate.", "tasks.engines", "tasks.draft",
                                                            "tasks.extract", "tasks.generate", "tasks.discover"))
                        and m != "tasks.gate.config")  # fmt: skip
    assert stage_code == []


def test_the_train_stage_sits_on_the_draft_and_only_the_flows_call_it() -> None:
    # The train stage composes the draft's training and export on the run folder; the other
    # stages and the layers below never reach up into it (benchmarks/ sits above, like flows/).
    below = ("tasks.draft", "tasks.extract", "tasks.runfolder", "tasks.config", "tasks.target")
    assert _outside("tasks.train", below) == {}
    assert {m: d for m, d in GRAPH.items() if not m.startswith(("tasks.train", "flows"))
            and any(i.startswith("tasks.train") for i in d)} == {}  # fmt: skip
    assert "tasks.train.stage" in GRAPH["flows.train"] and "tasks.train.stage" in GRAPH["tasks.train.main"]


def test_sglang_s_processes_stand_alone_in_tasks_sglang() -> None:
    # The command builder and the server process serve the gate, generation's server script and
    # the operator's launches alike: they live below all of them and reach up into none.
    assert {"tasks.sglang.command", "tasks.sglang.server_process"} <= GRAPH.keys()
    assert "tasks.sglang.server_process" in GRAPH["tasks.gate.benchmark"]
    assert _outside("tasks.sglang.") == {}
