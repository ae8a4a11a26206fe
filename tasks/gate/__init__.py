"""The benchmark gate: does the trained draft make the SGLang server faster? (DESIGN §6)

preflight.py  checks the draft folder against the launch before any GPU time is spent
launch.py     SGLang command lines per pinned version
server.py     launch, health wait, server-info check, log parsing (CUDA graphs, decode lines)
plan.py       held-out prompt set, configs, launch order, the records kept
protocol.py   the benchmark: fresh launches, warm-up, flush, repetitions, acceptance floor
decision.py   bootstrap CI and the promote/reject rules
report.py     gate/report.json, gate/report.md, gate/plots/*.png
promote.py    registry publish + promoted.json

`GateConfig` holds every threshold; `run_gate` runs all of it in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tasks.gate.launch import flag_set

if TYPE_CHECKING:
    from tasks.gate.server import Launcher
    from tasks.runfolder import RunFolder


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecPoint(_Strict):
    """One speculative configuration beyond the topk=1 num_steps sweep."""

    num_steps: int = Field(ge=1)
    topk: int = Field(ge=1)
    num_draft_tokens: int | None = Field(None, ge=2, description="Required when topk > 1.")


class GateConfig(_Strict):
    sglang_version: str = Field("0.5.23", description="Pinned SGLang version (launch flags differ).")
    python: str = Field("python", description="Interpreter that has sglang installed.")
    host: str = "127.0.0.1"
    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    cuda_graph_max_bs: int = Field(8, ge=1)
    extra_server_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="Applied to every launch.")
    nccl_env_sweep: list[dict[str, str]] = Field(
        default_factory=lambda: [{}],
        description="Each entry is one environment (e.g. NCCL settings) applied alike to the "
        "baseline and the speculative launches it is compared with.",
    )
    num_steps: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5], description="Swept at topk=1.")
    topk_points: list[SpecPoint] = Field(
        default_factory=lambda: [SpecPoint(num_steps=3, topk=4, num_draft_tokens=8)]
    )
    repetitions: int = Field(3, ge=2, description="Fresh launches per config (>= 2 to see spread).")
    num_prompts: int = Field(32, ge=1, description="Held-out prompts in the benchmark set.")
    prompt_seed: int = 0
    max_new_tokens: int = Field(256, ge=1)
    warmup_requests: int = Field(2, ge=1)
    acceptance_floor: float = Field(
        1.3, ge=1.0, description="Accept length below this after warm-up stops the gate."
    )
    min_speedup: float = Field(1.0, gt=0, description="Best median / baseline median must reach this.")
    ci_level: float = Field(0.95, gt=0.5, lt=1.0)
    n_bootstrap: int = Field(2000, ge=100)
    bootstrap_seed: int = 0
    min_exact_match: float = Field(
        0.95, ge=0.0, le=1.0, description="Fraction of outputs equal to the baseline's, token for token."
    )
    require_cuda_graphs: bool = Field(True, description="Graph capture and decode on graphs are required.")
    health_timeout_s: float = Field(1800.0, gt=0)
    health_poll_s: float = Field(2.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    registry_url: str | None = Field(None, description="Where promoted drafts go: a path or s3:// URL.")
    registry_storage_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("sglang_version")
    @classmethod
    def _pinned(cls, v: str) -> str:
        return flag_set(v).version  # raises naming the pinned versions

    @field_validator("num_steps")
    @classmethod
    def _steps(cls, v: list[int]) -> list[int]:
        if any(s < 1 for s in v) or len(set(v)) != len(v):
            raise ValueError(f"num_steps must be distinct integers >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _has_configs(self) -> GateConfig:
        if not self.num_steps and not self.topk_points:
            raise ValueError("num_steps and topk_points are both empty: nothing to benchmark")
        if not self.nccl_env_sweep:
            raise ValueError("nccl_env_sweep must have at least one entry ({} for the plain env)")
        return self


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
