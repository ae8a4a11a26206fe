"""The import arrows point down: the layers docs/DESIGN.md names import nothing of those above
them. Read from the source (every import, at module level or inside a function: a lazy import
is an arrow too), so a new upward import fails here rather than in a circular-import error."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    """Every module's imports, ours and third parties'."""
    imports: dict[str, set[str]] = {}
    for path in [*(ROOT / "tasks").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]:
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        imports[_module(path)] = names
    return imports


IMPORTS = _imports()
GRAPH = {m: {n for n in names if n.split(".")[0] in ("tasks", "flows")} for m, names in IMPORTS.items()}


def _closure(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        if m not in seen and m in GRAPH:
            seen.add(m)
            todo.extend(GRAPH[m])
    return seen


# The base of the failures the CLI reports without a traceback: below every layer, so any
# module may derive from it, and it imports nothing (checked below).
ERRORS_BASE = "tasks.errors"


def _outside(prefix: str, allowed: tuple[str, ...] = ()) -> dict[str, list[str]]:
    allowed = (*allowed, ERRORS_BASE)
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
    assert "rich.table" in IMPORTS["tasks.status.render"]
    assert "tasks.target.path_kinds" in GRAPH["tasks.config.paths"]


def test_the_errors_base_imports_nothing_and_sits_below_every_layer() -> None:
    # The run folder, SGLang's knowledge and the target derive from it: one import of its own
    # would be an arrow out of the bottom layers, or a circle.
    assert IMPORTS[ERRORS_BASE] <= {"__future__"}
    assert ERRORS_BASE in GRAPH["tasks.runfolder.folder"] and ERRORS_BASE in GRAPH["tasks.target.errors"]


def test_the_number_formatter_imports_nothing_of_ours_and_the_stories_only_it() -> None:
    # One formatter for every figure a person reads (tasks/humanize.py): any layer may import
    # it, so it may import none of them; the stage stories word the stages' summaries with it.
    assert "tasks.humanize" in GRAPH["tasks.notify"] and "tasks.humanize" in GRAPH["tasks.status.figures"]
    assert GRAPH["tasks.humanize"] == set() and GRAPH["tasks.story"] == {"tasks.humanize"}


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
    # The gate section's validator once reached the launch builder (tasks/gate/) for one check.
    reached = _closure("tasks.config")
    assert "tasks.config.gate_section" in reached and "tasks.sglang.versions" in reached
    stage_code = sorted(m for m in reached if m.startswith(("tasks.gate", "tasks.engines", "tasks.draft",
                                                            "tasks.extract", "tasks.generate", "tasks.discover")))  # fmt: skip
    assert stage_code == []


def test_the_status_view_reads_the_run_folder_alone_and_its_reading_draws_nothing() -> None:
    # `eaglescale status` works with no Prefect server and on a crashed run: it reads the run
    # folder through the run folder's own code, with the stage names and a duration format.
    assert _outside("tasks.status", ("tasks.runfolder", "tasks.humanize", "tasks.config")) == {}
    # A view of the run, not a step of it: no stage imports it.
    assert {m: d for m, d in GRAPH.items() if m.startswith("tasks") and not m.startswith("tasks.status")
            and any(i.startswith("tasks.status") for i in d)} == {}  # fmt: skip
    # Rendering is rich's; reading (what the flows' tests and the benchmarks call) loads none of it.
    reading = _closure("tasks.status.read") | _closure("tasks.status")
    assert "tasks.runfolder" in reading
    drawing = {m: sorted(n for n in IMPORTS[m] if n.split(".")[0] == "rich") for m in reading}
    assert {m: names for m, names in drawing.items() if names} == {}


def test_the_configuration_sits_on_sglang_knowledge_and_the_target_alone() -> None:
    # Its validators run SGLang's launch checks; its path checks read the target's helpers.
    assert _outside("tasks.config", ("tasks.sglang.", "tasks.target.")) == {}


def test_the_target_imports_nothing_above_it() -> None:
    # `tasks` itself: the tiny target reads its sample prompts from the package's data folder.
    above = {m: sorted(d for d in deps if d not in ("tasks", ERRORS_BASE) and not d.startswith("tasks.target"))
             for m, deps in GRAPH.items() if m.startswith("tasks.target")}  # fmt: skip
    assert {m: d for m, d in above.items() if d} == {}
    # Importing any target module runs tasks/target/__init__.py first: it imports nothing, so the
    # configuration's path helpers (path_kinds, packages) do not bring transformers or torch.
    assert GRAPH["tasks.target"] == set()


def test_the_target_families_are_data_reached_through_the_registry() -> None:
    # What eaglescale knows about each target family is one module in tasks/target/families/
    # (docs/TARGETS.md). The registry is read by model_dir.py, which the configuration reaches:
    # the package imports nothing outside itself and errors.py, and no third party (torch,
    # transformers) at all.
    package = {m for m in GRAPH if m.startswith("tasks.target.families")}
    assert {"tasks.target.families.registry", "tasks.target.families.base", "tasks.target.families.qwen3"} <= package
    assert _outside("tasks.target.families", ("tasks.target.errors",)) == {}
    third_party = {m: sorted(n for n in IMPORTS[m] if n.split(".")[0] not in sys.stdlib_module_names
                             and n.split(".")[0] != "tasks") for m in package}  # fmt: skip
    assert {m: names for m, names in third_party.items() if names} == {}
    # A family module imports only the interface, and nothing imports a family module: the
    # registry's list reaches them, so adding a family edits no other module.
    interface = {"tasks.target.families", "tasks.target.families.base", "tasks.target.families.registry"}
    families = package - interface
    assert {m: sorted(GRAPH[m] - {"tasks.target.families.base"}) for m in families if GRAPH[m] - {"tasks.target.families.base"}} == {}
    assert {m: sorted(d & families) for m, d in GRAPH.items() if d & families} == {}


def test_no_circles_between_modules_or_folders() -> None:
    # tasks/config.py and tasks/target.py once imported each other for two string helpers.
    target = [m for m in GRAPH if m.startswith("tasks.target")]
    assert target and not any(r.startswith("tasks.config") for m in target for r in _closure(m))
    circular = sorted(m for m, deps in GRAPH.items() if any(m in _closure(d) for d in deps))
    assert circular == []
    # Folders (tasks/config/, tasks/target/, tasks/gate/, ...; a top-level module is its own).
    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])

    arrows: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        arrows.setdefault(folder(m), set()).update(folder(d) for d in deps if folder(d) != folder(m))

    def reached(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(arrows.get(start, ()))
        while todo:
            f = todo.pop()
            if f not in seen:
                seen.add(f)
                todo.extend(arrows.get(f, ()))
        return seen

    assert sorted(f for f in arrows if f in reached(f)) == []


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


def test_the_product_imports_none_of_the_harness_or_the_benchmarks() -> None:
    # gpunode/ (the GPU node's harness) and benchmarks/ sit above the product: they run its stages
    # and read its records; tasks/ and flows/ never reach up into them.
    upward = {m: sorted(n for n in names if n.split(".")[0] in ("gpunode", "benchmarks")) for m, names in IMPORTS.items()}
    assert {m: names for m, names in upward.items() if names} == {}
    assert (ROOT / "gpunode/pipeline.py").is_file() and "tasks.gate.plan" in IMPORTS["tasks.dryrun"]
    # The harness runs no benchmark: benchmarks/ reads what the harness brought back, not the reverse.
    harness = {path.name: sorted(n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
                                 and n.module and n.module.split(".")[0] == "benchmarks")
               for path in (ROOT / "gpunode").glob("*.py")}  # fmt: skip
    assert len(harness) > 10 and {name: names for name, names in harness.items() if names} == {}
