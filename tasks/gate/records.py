"""What the gate's benchmark keeps: per request, per launch (its load levels, cost probes, the
server's log and re-score), and the whole benchmark; how the accept length is pooled over them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tasks.draft.acceptance import pooled_accept_length

if TYPE_CHECKING:
    from tasks.gate.plan import BenchConfig
    from tasks.gate.prompts import BenchPrompt


@dataclass
class RequestRecord:
    config: str
    env_name: str
    repetition: int
    prompt_index: int
    prompt_id: str
    domain: str
    completion_tokens: int = 0
    latency_s: float = 0.0
    tok_s: float | None = None
    server_e2e_latency_s: float | None = None
    spec_verify_ct: int | None = None
    accept_length: float | None = None
    correct_drafts_histogram: list[int] | None = None
    finish: str = ""
    output_sha: str = ""
    exact_match: bool | None = None
    first_mismatch: int | None = None
    error: str | None = None
    stop_token: int | None = None  # the token a "stop" finish matched
    reference: bool = False  # its output is the reference its environment's later requests are compared with
    divergence: dict[str, Any] | None = None  # tasks.gate.lossless.Divergence where the output leaves the reference
    concurrency: int = 1  # the load level it was sent at (requests in flight together)
    slot: int | None = None  # its place in the level's sequence (pairs launches at a level); None: prompt_index
    started_at: float | None = None  # wall clock when it was sent (beside the launch's gpu_samples)

    @property
    def column(self) -> int:
        return self.prompt_index if self.slot is None else self.slot


def accept_length(completion_tokens: int, verify_ct: int, requests: int = 1) -> float | None:
    """Tokens per verify step (tasks.draft.acceptance's definition). The first token of each
    request comes from prefill, not from a verify step, so it is left out: stuck acceptance
    reads exactly 1.0 whatever the length (SGLang's own per-request spec_accept_length,
    completion_tokens / spec_verify_ct, reads (n+1)/n)."""
    return pooled_accept_length(completion_tokens - requests, verify_ct)


def pooled_accept_lengths(records: list[RequestRecord]) -> tuple[float | None, dict[str, float]]:
    """Accept length over the successful speculative requests of `records`, overall and per
    domain: what the decision reports for a config, and gate/progress.json for each launch as
    it ends (a gate cut short keeps its per-domain figures)."""
    spec_ok = [r for r in records if r.error is None and r.spec_verify_ct]

    def pooled(rs: list[RequestRecord]) -> float | None:
        return accept_length(sum(r.completion_tokens for r in rs), sum(r.spec_verify_ct or 0 for r in rs), len(rs))

    per_domain = {d: pooled([r for r in spec_ok if r.domain == d]) for d in sorted({r.domain for r in spec_ok})}
    return pooled(spec_ok), {d: v for d, v in per_domain.items() if v is not None}


@dataclass
class LaunchRecord:
    config: str
    env_name: str
    repetition: int
    url: str
    log_path: str
    health_s: float | None = None
    server_info: dict[str, Any] = field(default_factory=dict)
    info_problems: list[str] = field(default_factory=list)
    info_notes: list[str] = field(default_factory=list)  # launch settings the server info omits
    graph_problems: list[str] = field(default_factory=list)
    log: dict[str, Any] = field(default_factory=dict)
    warmup_accept_length: float | None = None
    requests: list[RequestRecord] = field(default_factory=list)
    # Step costs, timed on probe requests after warm-up (not on the measured ones): the time to
    # the first token as the client sees it (prefill + the HTTP round trip: max_new_tokens 1),
    # then seconds per decode step (baseline) or per verify cycle (speculative: draft + verify +
    # extend), that first token's time taken out.
    probes: list[RequestRecord] = field(default_factory=list)
    prefill_s: float | None = None
    step_s: float | None = None
    started_at: float | None = None  # wall clock: the launch, the first measured request, the server stopped
    measured_at: float | None = None
    ended_at: float | None = None
    # Why this launch has no valid measurement: a speculative server that never served (with its
    # log tail), or a reference/scaling draft whose requests failed. The candidate's problems
    # stop the gate instead.
    error: str | None = None
    # A baseline launch's re-score of the references (tasks.gate.lossless.rescore_summary).
    rescore: dict[str, Any] = field(default_factory=dict)
    # Per load level (str(concurrency)): the level's wall time, output tokens and throughput
    # (LevelRun), and its cost probes ({"prefill_s", "step_s"}: a batch of `level` prompts timed
    # at max_new_tokens 1, then to the end, as at concurrency 1).
    levels: dict[str, dict[str, Any]] = field(default_factory=dict)
    level_costs: dict[str, dict[str, float | None]] = field(default_factory=dict)
    max_running_requests: int | None = None  # the running-request cap the server reported
    # The GPU's clocks, power and utilisation while it was measured (tasks/gate/gpu_samples.py),
    # each sample stamped with the wall clock; empty where nvidia-smi is absent.
    gpu_samples: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class BenchResult:
    configs: list[BenchConfig]
    prompts: list[BenchPrompt]
    repetitions: int
    launches: list[LaunchRecord] = field(default_factory=list)
    stopped: str | None = None

    def records(self, config: str, level: int | None = None) -> list[RequestRecord]:
        """The measured requests of `config`, at one concurrency level or (None) at every level."""
        return [r for launch_ in self.launches if launch_.config == config for r in launch_.requests
                if level is None or r.concurrency == level]  # fmt: skip

    def columns(self, level: int) -> int:
        """Request slots per launch at `level` (the width of its tok/s matrices)."""
        from tasks.gate.plan import level_requests

        return level_requests(level, len(self.prompts))

    def to_dict(self) -> dict[str, Any]:
        return {
            "configs": [{**asdict(c), "spec": asdict(c.spec) if c.spec else None} for c in self.configs],
            "prompts": [{"index": p.index, "prompt_id": p.prompt_id, "domain": p.domain, "prompt_tokens": len(p.input_ids)} for p in self.prompts],
            "repetitions": self.repetitions,
            "launches": [asdict(x) for x in self.launches],
            "stopped": self.stopped,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        """A benchmark as report.json's `bench` holds it, to judge again with the decision as it
        is now (a prompt comes back with its token count, not its ids: nothing decides on them)."""
        from tasks.gate.plan import BenchConfig
        from tasks.gate.prompts import BenchPrompt
        from tasks.sglang.command import SpecParams

        configs = [BenchConfig(**{**c, "spec": SpecParams(**c["spec"]) if c["spec"] else None, "env": dict(c["env"]),
                                  "notes": tuple(c["notes"])}) for c in d["configs"]]  # fmt: skip
        prompts = [BenchPrompt(p["index"], p["prompt_id"], p["domain"], (0,) * p["prompt_tokens"]) for p in d["prompts"]]
        launches = []
        for x in d["launches"]:
            fields = {**x, "requests": [RequestRecord(**r) for r in x["requests"]],
                      "probes": [RequestRecord(**r) for r in x["probes"]]}  # fmt: skip
            launches.append(LaunchRecord(**fields))
        return cls(configs, prompts, d["repetitions"], launches, d.get("stopped"))
