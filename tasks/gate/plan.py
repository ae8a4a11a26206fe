"""What the gate benchmarks: the configs (baseline, num_steps sweep at topk=1, topk>1 points, per
environment of the NCCL sweep, the contenders' drafts, break-even and policy launches), the
launch order and each launch's load levels. What it keeps is tasks/gate/records.py; its prompts,
tasks/gate/prompts.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tasks.config.gate_section import GateConfig
from tasks.errors import ExpectedFailure
from tasks.sglang.command import SpecParams, resolve_spec
from tasks.sglang.simulated_acceptance import SIMULATE_ACC_LEN


class GateStopped(RuntimeError, ExpectedFailure):
    """The benchmark cannot give valid evidence; the message is the diagnosis."""


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


@dataclass(frozen=True)
class LaunchForecast:
    """What a gate will launch, before it runs: the launches by role (repetitions counted; the
    serving policy's pair with several load levels, a draft the sweep would promote), the
    measured requests and output tokens, and the device seconds at gate.forecast_launch_s a
    start-up and gate.forecast_tok_s a request in flight (the probes and replay not counted)."""

    launches: dict[str, int]
    requests: int
    output_tokens: int
    device_s: float

    @property
    def total(self) -> int:
        return sum(self.launches.values())


def forecast_launches(cfg: GateConfig, draft_dir: str = "DRAFT", extra: list[ExtraDraft] | None = None) -> LaunchForecast:
    """The launches plan_configs and launch_order make of `cfg` (and of `extra`: the incumbent,
    challengers and data-scaling drafts), and a forecast of their device time."""
    configs = plan_configs(cfg, draft_dir, extra)
    order = launch_order(configs, cfg.repetitions)
    by_role: dict[str, int] = {}
    for _, config in order:
        role = "baseline" if config.is_baseline else config.role
        by_role[role] = by_role.get(role, 0) + 1
    if len(cfg.concurrency) > 1:
        by_role[POLICY] = 2
    n_prompts = cfg.num_prompts
    requests = tokens = 0
    seconds = cfg.forecast_launch_s * sum(by_role.values())
    for _, config in [*order, *[(0, configs[0])] * by_role.get(POLICY, 0)]:
        prompts = min(cfg.breakeven_prompts, n_prompts) if config.role == BREAKEVEN else n_prompts
        for i, level in enumerate(load_levels(cfg, config)):
            n = level_requests(level, prompts)
            requests += n
            tokens += n * cfg.max_new_tokens
            seconds += n * cfg.max_new_tokens / (cfg.forecast_tok_s * level)
            # Above the lowest level, the admission probe: 4 x level requests of half max_new_tokens on average, level at a time.
            seconds += 2 * cfg.max_new_tokens / cfg.forecast_tok_s if i else 0.0
    return LaunchForecast(by_role, requests, tokens, seconds)
