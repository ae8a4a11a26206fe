"""The benchmark gate: does the trained draft make the SGLang server faster? (DESIGN §6)

preflight.py  checks the draft folder against the launch before any GPU time is spent
launch.py     SGLang command lines per pinned version
server.py     launch, health wait, server-info check, log parsing (CUDA graphs, decode lines)
plan.py       held-out prompt set, configs, launch order, the records kept
protocol.py   the benchmark: fresh launches, warm-up, flush, repetitions, acceptance floor
decision.py   bootstrap CI and the promote/reject rules
report.py     gate/report.json, gate/report.md, gate/plots/*.png
promote.py    registry publish + promoted.json

config.py     GateConfig: every threshold (the `gate` section of the run's configuration)
local.py      the same protocol on the in-process speculative engine (CPU boxes, the demo)
stage.py      the gate stage: offline replay, cost model, benchmark, decision, promotion

`run_gate` runs the SGLang path in order. Nothing here imports pydantic at import time except
config.py, so replay and the cost model load on GPU images that lack it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.gate.config import GateConfig
    from tasks.gate.server import Launcher
    from tasks.runfolder import RunFolder


def run_gate(
    run: RunFolder,
    cfg: GateConfig,
    *,
    model_path: str,
    draft_dir: str,
    target_config: dict[str, Any],
    launcher: Launcher,
    encode: Any,
    work_dir: Path,
    aux_layer_ids: list[int] | None = None,
    draft_storage_options: dict[str, Any] | None = None,
    predictions: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Preflight, benchmark, decide, report, promote; returns the summary for Slack.

    `draft_dir` is the SGLang export folder, readable by the server; `encode(messages)` gives a
    prompt's token ids (protocol.encoder_for_target); `work_dir` holds the server logs.
    Raises PreflightError before any launch, ServerStartError when a server never serves.
    """
    from tasks.gate.decision import decide
    from tasks.gate.plan import load_bench_prompts, plan_configs
    from tasks.gate.preflight import preflight_sweep
    from tasks.gate.promote import promote
    from tasks.gate.protocol import GateRunner
    from tasks.gate.report import write_gate_report

    configs = plan_configs(cfg, draft_dir)
    preflight_sweep(
        draft_dir, [c.spec for c in configs if c.spec is not None], target_config, aux_layer_ids,
        storage_options=draft_storage_options,
    )  # fmt: skip
    prompts = load_bench_prompts(run, cfg.num_prompts, cfg.prompt_seed, encode)
    result = GateRunner(cfg, launcher, model_path, configs, prompts, work_dir).run()
    decision = decide(result, cfg)
    write_gate_report(run, decision, result, cfg, predictions)
    return promote(
        run, decision, draft_dir, cfg.registry_url,
        registry_storage_options=cfg.registry_storage_options,
        draft_storage_options=draft_storage_options,
    )  # fmt: skip
