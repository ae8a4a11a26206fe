"""The `gate` section of the run's configuration: which engine benchmarks the draft, the sweep,
the protocol's sizes, and every threshold of the promote/reject decision."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.config.strict import Strict
from tasks.sglang.server_settings import ServerSettings
from tasks.sglang.versions import PINNED_VERSIONS, check_server_config, flag_set


class SpecPoint(Strict):
    """One speculative configuration beyond the topk=1 num_steps sweep."""

    num_steps: int = Field(ge=1)
    topk: int = Field(ge=1)
    num_draft_tokens: int | None = Field(None, ge=2, description="Required when topk > 1.")


class Challenger(Strict):
    """A draft from elsewhere (e.g. a public trainer's, on the same target) benchmarked beside
    the run's own under the same protocol: reported with its speedup, CI and margin, never
    promoted. One that fails preflight (or is missing) is reported with the reason and left out."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Short name used in the report's config names.")
    path: str = Field(
        description="SGLang EAGLE3 draft folder: a local path, or an s3:// URL (copied to the node with "
        "the run's storage_options before the launches)."
    )
    num_steps: int = Field(3, ge=1)
    topk: int = Field(1, ge=1)
    num_draft_tokens: int | None = Field(None, ge=2, description="Required when topk > 1.")


class GateConfig(Strict):
    engine: Literal["local", "sglang", "emulated"] = Field(
        "local",
        description="local: the in-process speculative engine (transformers target + the draft); "
        "sglang: fresh SGLang launches (GPU nodes, the production evidence); emulated: the "
        "package's SGLang-compatible emulator, launched exactly as SGLang would be (CI, dry runs).",
    )
    device: str = Field(
        "cpu", description="torch device of the gate's own torch work: offline replay, and the local "
        "engine's target and draft (cuda on a GPU node: replay takes seconds there, minutes on the CPU).",
    )
    cuda_graphs: bool = Field(True, description="local engine on CUDA: capture verify/draft steps as graphs.")
    emulator: dict[str, Any] = Field(
        default_factory=dict, description="emulated engine: EmulatorConfig fields (speed, acceptance)."
    )
    replay_sequences: int = Field(
        256, ge=1, description="Held-out extracted sequences replayed offline (the cost model's input)."
    )
    cost_iters: int = Field(50, ge=1, description="local engine: timed runs per step cost.")
    sglang_version: str = Field(
        "0.5.23", description=f"Pinned SGLang version, one of {list(PINNED_VERSIONS)} (launch flags differ)."
    )
    python: str = Field("python", description="Interpreter that has sglang installed.")
    host: str = "127.0.0.1"
    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    cuda_graph_max_bs: int = Field(8, ge=1)
    server: ServerSettings = Field(
        default_factory=ServerSettings,
        description="SGLang server settings shared by every launch (attention/sampling/grammar "
        "backend, --skip-tokenizer-init, dtype, prefill graphs, ...); each unset one is SGLang's default.",
    )
    extra_server_args: list[str] = Field(
        default_factory=list,
        description="Further launch_server flags, checked against the version's flags before any launch.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Applied to every launch.")
    nccl_env_sweep: list[dict[str, str]] = Field(
        default_factory=lambda: [{}],
        description="Each entry is one environment (e.g. NCCL settings) applied alike to the "
        "baseline and the speculative launches it is compared with.",
    )
    num_steps: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5], description="Swept at topk=1.")
    topk_points: list[SpecPoint] = Field(
        default_factory=lambda: [SpecPoint(num_steps=3, topk=4, num_draft_tokens=8)],
        description="topk > 1 points (SGLang engines; the local engine drafts chains only).",
    )
    repetitions: int = Field(
        3, ge=1, description="Fresh launches per config (>= 2 to see the run-to-run spread; 1 only in a rehearsal, "
        "gate.simulated_acceptance, whose CI then resamples requests alone).",
    )  # fmt: skip
    concurrent_servers: int = Field(
        1,
        ge=1,
        description="SGLang engines: launches started together, in protocol order. 1: launch, measure, "
        "stop, one at a time (production targets fill their GPUs). N > 1: N servers start at once and, "
        "once all serve, each is measured alone while the others wait idle (small targets that fit "
        "many times on one GPU, whose gate start-up would otherwise dwarf its measurement). Needs a "
        "bounded KV pool per server (mem_fraction_static and server.max_total_tokens) and, to keep idle "
        "servers off the CPU, server.sleep_on_idle.",
    )
    challengers: list[Challenger] = Field(
        default_factory=list,
        description="Drafts from elsewhere measured beside ours; never promoted. The report says when one is faster.",
    )
    incumbent: Literal["evidence", "sweep", "off"] = Field(
        "evidence",
        description="The registry's promoted draft for the same target, benchmarked beside the new one: the new "
        "draft must beat it beyond the spread too. evidence: at the config its promotion recorded as best; "
        "sweep: at every config of num_steps and topk_points; off: not benchmarked (the baseline rule alone).",
    )
    scaling_num_steps: int = Field(
        3, ge=1, description="num_steps (topk 1) at which the train stage's data-scaling drafts are measured."
    )
    forecast_launch_s: float = Field(
        75.0, gt=0, description="The dry run's forecast of the gate's device time: seconds from a launch to "
        "serving (75: Qwen2.5-Coder-1.5B on one H100 with SGLang 0.5.14, warm kernels, BENCHMARKS P31; a cold "
        "first launch takes ~90 s more).",
    )  # fmt: skip
    forecast_tok_s: float = Field(
        450.0, gt=0, description="The dry run's forecast: the baseline's output tok/s per request in flight "
        "(450: the same target's ~430-480 at concurrency 1, BENCHMARKS P28/P32).",
    )  # fmt: skip
    concurrency: list[int] = Field(
        default_factory=lambda: [1],
        description="Load levels (requests in flight together) every launch measures in turn, over the same "
        "held-out prompts: at level C, max(num_prompts, 3C, 24) requests (num_prompts at 1). The decision is per "
        "level: a draft ships with a serving policy that speculates only where it is faster and is never slower "
        "than the baseline beyond the spread at any level (docs/GATE.md, the gate at load). The local engine "
        "decodes one request at a time: [1] only.",
    )
    deploy_concurrency: int | None = Field(
        None, description="The level of gate.concurrency the headline speedup is read at (the load the "
        "deployment serves); None: the lowest level.",
    )  # fmt: skip
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
    require_cuda_graphs: bool = Field(
        True, description="SGLang engines: graph capture and decode on graphs are required."
    )
    health_timeout_s: float = Field(1800.0, gt=0)
    health_poll_s: float = Field(2.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    registry_url: str | None = Field(None, description="Where promoted drafts go: a path or s3:// URL.")
    registry_storage_options: dict[str, Any] = Field(default_factory=dict)
    # The lossless rule (tasks/gate/lossless.py): each speculative output equals the baseline's
    # reference or first leaves it at a near-tie, as judged by the baseline's prefill re-score.
    near_tie_nats: float = Field(
        0.625, gt=0,
        description="How far below the baseline's best logprob at a divergence both tokens may lie for it to count as "
        "a near-tie a bf16 verify may flip: SGLang's verify path moved a token's logprob by up to 0.312 nats from "
        "its prefill's on SmolLM2 (BENCHMARKS P13), so a gap by up to ~0.62; a frequency penalty's real "
        "changes of output lay at 0.75 and beyond. Measure a new target with the node's verify-probe plan.",
    )  # fmt: skip
    top_logprobs_num: int = Field(
        5, ge=2, description="Top tokens per position in the baseline's re-score (SGLang's top_logprobs_num): a "
        "speculative token outside them is refused with the gap bounded by the K-th's logprob.",
    )  # fmt: skip
    verify_logprobs: Literal["off", "refused", "diverged"] = Field(
        "refused",
        description="SGLang server engines, untimed after a speculative launch's measured requests: each request "
        "refused as not lossless (refused) or each that left the baseline's output (diverged) is sent again with "
        "return_logprob, and the speculative path's own logprobs at and before the divergence are recorded beside "
        "the verdict (tasks/gate/lossless.py verify_view): evidence for the threshold, never deciding it.",
    )  # fmt: skip
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0,
        description="Sent in every benchmark request's sampling params (SGLang server engines). SGLang applies "
        "penalties in a relaxed way under speculative decoding: a gate run with one shows that change of output "
        "refused as not lossless.",
    )  # fmt: skip
    # Break-even measured on the server (tasks/gate/breakeven.py).
    breakeven_accept_lengths: list[float] = Field(
        default_factory=list,
        description="SGLang server engines: per num_steps of the sweep, one launch per accept length with "
        "SGLANG_SIMULATE_ACC_LEN set (the real verify pipeline, acceptance forced to that mean), whose tok/s "
        "against the baseline's gives the server's own break-even accept length. Never promoted. Empty: off.",
    )
    breakeven_prompts: int = Field(8, ge=1, description="Benchmark prompts sent to each break-even launch.")
    simulated_acceptance: dict[str, float] = Field(
        default_factory=dict,
        description="A rehearsal (SGLang server engines): the sweep's speculative configs named here (by label, e.g. "
        "eagle3-s3-k1-n4) run with SGLANG_SIMULATE_ACC_LEN at the given accept length, and every request runs to "
        "max_new_tokens (their outputs are filler): the whole gate at load, its serving policy and the policy's own "
        "launch, for a draft of those accept lengths on this server and target. Nothing is promoted (outcome "
        "'rehearsal'). Empty: off.",
    )
    simulated_reply_tokens: list[int] = Field(
        default_factory=list,
        description="A rehearsal's reply lengths (with simulated_acceptance): a measured request for held-out prompt i "
        "runs to simulated_reply_tokens[i % len] new tokens (each at most max_new_tokens), the same on every launch, "
        "so requests end one at a time and each end admits the next mid-batch, as real replies that stop at their "
        "own lengths do (BENCHMARKS P35: where the draft stops paying depends on it). E.g. a real gate's reply "
        "lengths at concurrency 1. Empty: every request to max_new_tokens, and a level's requests end in waves.",
    )
    breakeven_num_steps: list[int] | None = Field(
        None,
        description="The num_steps (topk 1) the break-even launches run at, whether or not the sweep measures "
        "them: the server's cost at a draft length needs the draft, not its acceptance. None: every topk=1 "
        "num_steps of the sweep. A session that measures num_steps 4 and 5 can so measure the break-even at 3.",
    )

    @model_validator(mode="after")
    def _lossless_settings(self) -> GateConfig:
        if any(not x >= 1.0 for x in self.breakeven_accept_lengths):
            raise ValueError(f"gate.breakeven_accept_lengths must be tokens per verify >= 1, got {self.breakeven_accept_lengths}")
        if self.breakeven_num_steps is not None and any(k < 1 for k in self.breakeven_num_steps):
            raise ValueError(f"gate.breakeven_num_steps must be draft steps >= 1, got {self.breakeven_num_steps}")
        if self.simulated_acceptance:
            self._check_simulated()
        elif self.simulated_reply_tokens:
            raise ValueError("gate.simulated_reply_tokens is a rehearsal's (gate.simulated_acceptance): a real draft's "
                             "replies end at their own lengths")  # fmt: skip
        elif self.repetitions < 2:
            raise ValueError(f"gate.repetitions {self.repetitions}: at least 2 fresh launches per config, to see the "
                             "run-to-run spread (1 only in a rehearsal, gate.simulated_acceptance)")  # fmt: skip
        if self.engine == "local" and self.breakeven_accept_lengths:
            raise ValueError("gate.breakeven_accept_lengths needs an SGLang server (gate.engine sglang or emulated): "
                             "the local engine has no simulated acceptance")  # fmt: skip
        if self.engine == "local" and self.frequency_penalty:
            raise ValueError("gate.frequency_penalty needs an SGLang server (gate.engine sglang or emulated): "
                             "the local engine decodes without penalties")  # fmt: skip
        return self

    def _check_simulated(self) -> None:
        if self.engine == "local":
            raise ValueError("gate.simulated_acceptance needs an SGLang server (gate.engine sglang or emulated)")
        points = {f"eagle3-s{s}-k1-n{s + 1}": s for s in self.num_steps}
        points |= {f"eagle3-s{p.num_steps}-k{p.topk}-n{p.num_draft_tokens}": p.num_steps for p in self.topk_points}
        for label, x in self.simulated_acceptance.items():
            if label not in points:
                raise ValueError(f"gate.simulated_acceptance: {label!r} is not a config of the sweep ({sorted(points)})")
            if not 1.0 <= x <= points[label] + 1:
                raise ValueError(f"gate.simulated_acceptance[{label!r}] {x} is outside [1, {points[label] + 1}] tokens per verify")
        wrong = [(i, n) for i, n in enumerate(self.simulated_reply_tokens) if not 2 <= n <= self.max_new_tokens]
        if wrong:
            i, n = wrong[0]
            raise ValueError(f"gate.simulated_reply_tokens[{i}] {n} is outside [2, max_new_tokens {self.max_new_tokens}] "
                             f"({len(wrong)} such)")  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reference_drafts" in data:
            raise ValueError("gate.reference_drafts is now gate.challengers (the same fields: name, path, num_steps, ...)")
        if isinstance(data, dict) and "min_exact_match" in data:
            raise ValueError("gate.min_exact_match is gone: outputs must be lossless (equal to the baseline's, or first "
                             "leaving it at a near-tie within gate.near_tie_nats), see tasks/gate/lossless.py")  # fmt: skip
        return data

    @field_validator("sglang_version")
    @classmethod
    def _pinned(cls, v: str) -> str:
        return flag_set(v).version  # raises naming the pinned versions

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"gate.concurrency must be distinct integers >= 1 (requests in flight), got {v}")
        return sorted(v)

    @model_validator(mode="after")
    def _load_levels(self) -> GateConfig:
        if self.deploy_concurrency is not None and self.deploy_concurrency not in self.concurrency:
            raise ValueError(f"gate.deploy_concurrency {self.deploy_concurrency} is not one of gate.concurrency {self.concurrency}")
        top = max(self.concurrency)
        if self.engine == "local" and top > 1:
            raise ValueError(f"gate.concurrency {self.concurrency}: the local engine decodes one request at a time "
                             "(concurrency [1]); measure load on an SGLang server (gate.engine sglang or emulated)")  # fmt: skip
        if self.engine != "local" and self.require_cuda_graphs and self.cuda_graph_max_bs < top:
            raise ValueError(f"gate.cuda_graph_max_bs {self.cuda_graph_max_bs} is below the highest gate.concurrency {top}: "
                             "larger batches would decode without CUDA graphs (and fail require_cuda_graphs); set "
                             f"cuda_graph_max_bs to at least {top}")  # fmt: skip
        return self

    @property
    def deploy_level(self) -> int:
        """The concurrency the headline speedup is read at."""
        return self.deploy_concurrency if self.deploy_concurrency is not None else self.concurrency[0]

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
        if self.engine == "local" and not self.num_steps:
            raise ValueError("the local engine drafts chains (topk=1) only: num_steps is empty")
        # Settings the version lacks, unknown or deprecated extra flags: refused at load time.
        check_server_config(self.server.model_dump(), self.extra_server_args, self.sglang_version)
        if not self.nccl_env_sweep:
            raise ValueError("nccl_env_sweep must have at least one entry ({} for the plain env)")
        if self.concurrent_servers > 1 and self.engine == "sglang" and (
            self.mem_fraction_static is None or self.server.max_total_tokens is None
        ):
            # SGLang sizes its KV pool from the memory free when it starts: servers starting
            # together would each claim most of the GPU, or race each other to an OOM.
            raise ValueError(
                f"gate.concurrent_servers {self.concurrent_servers} with gate.engine sglang needs "
                "gate.mem_fraction_static and gate.server.max_total_tokens (a bounded KV pool per server)"
            )
        if self.challengers and self.engine == "local":
            raise ValueError("gate.challengers are measured on SGLang servers; gate.engine is local")
        names = [c.name for c in self.challengers]
        if len(set(names)) != len(names):
            raise ValueError(f"gate.challengers repeat a name: {names}")
        return self
