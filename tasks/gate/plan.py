"""What the gate benchmarks, and the records it keeps: the held-out prompt set, the configs
(baseline, num_steps sweep at topk=1, topk>1 points, per environment of the NCCL sweep), the
launch order, and per-request / per-launch records."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa

from tasks.config.gate_section import GateConfig
from tasks.draft.acceptance import pooled_accept_length
from tasks.runfolder import RunFolder
from tasks.sglang.command import SpecParams, resolve_spec
from tasks.sglang.simulated_acceptance import SIMULATE_ACC_LEN

Encoder = Callable[[list[dict[str, Any]]], list[int]]


class GateStopped(RuntimeError):
    """The benchmark cannot give valid evidence; the message is the diagnosis."""


@dataclass(frozen=True)
class BenchPrompt:
    index: int
    prompt_id: str
    domain: str
    input_ids: tuple[int, ...]


def select_prompts(table: pa.Table, n: int, seed: int, encode: Encoder) -> list[BenchPrompt]:
    """n held-out prompts in a seeded order, domains taken round-robin so a small n covers all.

    The order depends on (seed, prompt_id) only, never on the table's row order."""
    rows = table.select(["prompt_id", "domain", "messages"]).to_pylist()
    if not rows:
        raise GateStopped("the held-out prompt set is empty (discover.holdout_per_domain is 0?)")
    by_domain: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r['prompt_id']}".encode()).digest()):
        by_domain.setdefault(row["domain"], []).append(row)
    picked: list[dict[str, Any]] = []
    queues = [by_domain[d] for d in sorted(by_domain)]
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return [
        BenchPrompt(i, r["prompt_id"], r["domain"], tuple(encode(json.loads(r["messages"]))))
        for i, r in enumerate(picked)
    ]


def load_bench_prompts(run: RunFolder, n: int, seed: int, encode: Encoder) -> list[BenchPrompt]:
    from tasks.discover.commit import read_prompts_table

    return select_prompts(read_prompts_table(run, "holdout"), n, seed, encode)


def encoder_for_target(model_path: str, chat_template: str | None = None) -> Encoder:
    """Prompt ids as generation rendered them: the target's tokenizer and chat template."""
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    tokenizer = load_tokenizer(model_path, chat_template)
    return lambda messages: render_prompt_ids(tokenizer, messages)


# What a speculative config benchmarks: the run's own draft (the only one that can be promoted),
# the registry's promoted draft for the same target (which the run's must beat), a draft from
# elsewhere measured beside it (e.g. a public trainer's), or one of the train stage's
# data-scaling drafts (measured once, for the curve); or the run's draft with its acceptance forced
# by SGLANG_SIMULATE_ACC_LEN (once per accept length: the server's own break-even, never promoted).
CANDIDATE, INCUMBENT, CHALLENGER, SCALING = "candidate", "incumbent", "challenger", "scaling"
BREAKEVEN = "breakeven"
# The serving policy's own launch pair (tasks/gate/serving_policy.py): a baseline and the run's
# draft under the policy (SGLang's adaptive speculation), measured after the sweep at every load
# level; what a multi-level gate promotes on.
POLICY = "policy"
POLICY_CONFIG, POLICY_BASELINE = "serving-policy", "baseline-for-policy"
NEW_DRAFT = "new draft"  # the contender name of the run's own draft in reports
DEFAULT_ENV = "default"  # the environment name when gate.nccl_env_sweep has one entry


def is_default_chain(env_name: str, topk: int | None) -> bool:
    """A config of the default environment that is the baseline (topk None) or a chain (topk 1):
    what the local engine can run, and the configs the replay and the scaling curve line up with."""
    return env_name == DEFAULT_ENV and topk in (None, 1)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    spec: SpecParams | None
    env_name: str
    env: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    role: str = CANDIDATE
    repetitions: int | None = None  # launches of this config; None: the gate's repetitions
    samples: int | None = None  # scaling drafts: training sequences
    draft: str = NEW_DRAFT  # the contender whose draft it runs (an ExtraDraft's name)
    simulated_accept_length: float | None = None  # BREAKEVEN: the SGLANG_SIMULATE_ACC_LEN it runs with
    adaptive_config: str | None = None  # POLICY: the SGLang adaptive config file it launches with

    @property
    def is_baseline(self) -> bool:
        return self.spec is None


def load_levels(cfg: GateConfig, config: BenchConfig) -> list[int]:
    """The concurrency levels a launch of `config` measures: every gate.concurrency level, except
    for launches that measure acceptance or cost only (break-even, data-scaling drafts), which
    measure the lowest."""
    return cfg.concurrency[:1] if config.role in (BREAKEVEN, SCALING) else list(cfg.concurrency)


def level_requests(level: int, n_prompts: int) -> int:
    """Requests one launch sends at a concurrency level: every held-out prompt, and at least 3
    per request slot and 24 in all, for a CI at that level (prompts repeat in order beyond n)."""
    return max(n_prompts, 3 * level, 24) if level > 1 else n_prompts


@dataclass(frozen=True)
class ExtraDraft:
    """A draft benchmarked beside the candidate at one config: the incumbent, a challenger or a
    scaling draft."""

    name: str
    path: str
    num_steps: int
    topk: int = 1
    num_draft_tokens: int | None = None
    role: str = CHALLENGER
    samples: int | None = None


@dataclass(frozen=True)
class Incumbent:
    """The registry's promoted draft for this target, as the gate benchmarks it."""

    draft_id: str
    uri: str
    num_steps_from: str  # "evidence" (its promotion's best config) or "sweep" (the gate's configs)
    record: dict[str, Any] = field(default_factory=dict, compare=False)  # its promoted.json record


@dataclass(frozen=True)
class LeftOut:
    """A contender that was not benchmarked, and why (a challenger that fails preflight, an
    incumbent for another target): reported, never fatal."""

    name: str
    role: str
    path: str
    reason: str


SweepPoint = tuple[int, int, int | None]  # num_steps, topk, num_draft_tokens (None at topk 1: steps + 1)


def sweep_points(cfg: GateConfig) -> list[SweepPoint]:
    """The speculative configs of the gate's sweep, in order: num_steps at topk 1, then
    topk_points. The one list for the run's draft, an incumbent measured over the sweep, and a
    draft promoted by hand (checked where a later gate will measure it)."""
    return [(s, 1, None) for s in cfg.num_steps] + [(p.num_steps, p.topk, p.num_draft_tokens) for p in cfg.topk_points]


def plan_configs(cfg: GateConfig, draft_dir: str, extra: list[ExtraDraft] | None = None) -> list[BenchConfig]:
    specs = [resolve_spec(draft_dir, s, k, n) for s, k, n in sweep_points(cfg)]
    others = [(d, resolve_spec(d.path, d.num_steps, d.topk, d.num_draft_tokens)) for d in extra or []]
    names = [s.label for s, _ in specs] + [f"{d.name}:{s.label}" for d, (s, _) in others]
    if len(set(names)) != len(names):
        raise ValueError(f"gate config repeats a speculative config: {names}")
    configs = []
    for i, env in enumerate(cfg.nccl_env_sweep):
        env_name = DEFAULT_ENV if len(cfg.nccl_env_sweep) == 1 else f"env{i}"
        suffix = "" if env_name == DEFAULT_ENV else f"@{env_name}"
        configs.append(BenchConfig(f"baseline{suffix}", None, env_name, dict(env)))
        configs += [rehearsed(cfg, BenchConfig(f"{s.label}{suffix}", s, env_name, dict(env), tuple(n))) for s, n in specs]
        configs += [
            BenchConfig(f"{d.name}:{s.label}{suffix}", s, env_name, dict(env), tuple(n), role=d.role,
                        repetitions=1 if d.role == SCALING else None, samples=d.samples, draft=d.name)
            for d, (s, n) in others
        ]  # fmt: skip
    at = [s for s, _ in specs] if cfg.breakeven_num_steps is None else [
        resolve_spec(draft_dir, k, 1, None)[0] for k in cfg.breakeven_num_steps]  # fmt: skip
    return configs + breakeven_configs(cfg, at, configs[0])


def rehearsed(cfg: GateConfig, config: BenchConfig) -> BenchConfig:
    """`config` with its acceptance forced when gate.simulated_acceptance names it (a rehearsal)."""
    x = cfg.simulated_acceptance.get(config.spec.label) if config.spec else None
    if x is None:
        return config
    note = f"acceptance forced to a mean of {x:g} tokens per verify (gate.simulated_acceptance): a rehearsal"
    return replace(config, env={**config.env, SIMULATE_ACC_LEN: f"{x:g}"}, notes=(*config.notes, note),
                   simulated_accept_length=x)  # fmt: skip


def is_filler(config: BenchConfig) -> bool:
    """Its outputs are filler (acceptance forced): never compared with the baseline's."""
    return config.simulated_accept_length is not None


def breakeven_configs(cfg: GateConfig, specs: list[SpecParams], baseline: BenchConfig) -> list[BenchConfig]:
    """One launch per topk=1 config of `specs` (the sweep's, or gate.breakeven_num_steps') and
    gate.breakeven_accept_lengths entry, in the first environment, SGLANG_SIMULATE_ACC_LEN set;
    accept lengths beyond num_steps + 1 (which SGLang clamps) are left out."""
    return [
        BenchConfig(f"{s.label}+acc{x:g}", s, baseline.env_name, {**baseline.env, SIMULATE_ACC_LEN: f"{x:g}"},
                    (f"acceptance forced to a mean of {x:g} tokens per verify: the server's cost, never promoted",),
                    role=BREAKEVEN, repetitions=1, simulated_accept_length=x)
        for s in specs if s.topk == 1 for x in cfg.breakeven_accept_lengths if x <= s.num_steps + 1
    ]  # fmt: skip


def launch_order(configs: list[BenchConfig], repetitions: int) -> list[tuple[int, BenchConfig]]:
    """Every (repetition, config) launch: per repetition and environment the baseline and the
    speculative configs alternating (see tasks/gate/benchmark.py); the break-even launches last,
    as the decision never reads them (a gate cut short by its device time loses them first)."""
    order = []
    measured = [c for c in configs if c.role != BREAKEVEN]
    for rep in range(repetitions):
        for env_name in dict.fromkeys(c.env_name for c in measured):
            group = [c for c in measured if c.env_name == env_name and (c.repetitions is None or rep < c.repetitions)]
            specs = [c for c in group if not c.is_baseline]
            k = rep % len(specs) if specs else 0
            seq = [c for c in group if c.is_baseline] + specs[k:] + specs[:k]
            order += [(rep, c) for c in (seq if rep % 2 == 0 else seq[::-1])]
    return order + [(0, c) for c in configs if c.role == BREAKEVEN]


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
        return level_requests(level, len(self.prompts))

    def to_dict(self) -> dict[str, Any]:
        return {
            "configs": [{**asdict(c), "spec": asdict(c.spec) if c.spec else None} for c in self.configs],
            "prompts": [{"index": p.index, "prompt_id": p.prompt_id, "domain": p.domain, "prompt_tokens": len(p.input_ids)} for p in self.prompts],
            "repetitions": self.repetitions,
            "launches": [asdict(x) for x in self.launches],
            "stopped": self.stopped,
        }
