"""Promote or reject, with the numbers behind it (docs/GATE.md).

Rule: the best eligible speculative config of the run's draft (highest median tok/s) is
promoted only if its median beats the best baseline's median by more than the run-to-run
spread, i.e. the bootstrap CI of the speedup lies above 1.0, the point speedup reaches
`min_speedup`, and its outputs agree with the baseline's; and, when the registry holds a
promoted draft for the same target (the incumbent, benchmarked beside it), its median beats
the incumbent's best eligible config beyond the spread too (the CI of the ratio of the two
medians lies above 1.0). Eligible: no failed request, every output lossless (equal to the
baseline's reference, or first leaving it at a near-tie of the target's distribution within
`near_tie_nats`: tasks/gate/lossless.py), accept length at or above the floor, CUDA graphs
captured and used (when required), server info echoing the launch. An incumbent that gives no
valid measurement leaves the baseline rule alone, and the decision says so. Challengers are
measured and compared, never promoted: one faster than the run's draft is reported; break-even
launches (simulated acceptance) measure the server's cost only (tasks/gate/breakeven.py). The
baseline's second launch is classified against its first the same way: a not-lossless divergence
there is reported loudly (the threshold or the server is off).

Bootstrap: each resample draws prompts with replacement (the same prompts for both sides:
the comparison is paired by prompt) and, independently for each side, repetitions (fresh
launches) with replacement, then takes the ratio of the medians of per-request tok/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tasks.config.gate_section import GateConfig
from tasks.gate.breakeven import measure_breakeven
from tasks.gate.load import (
    LevelSummary,
    crossover,
    level_summary,
    measured_levels,
    rate_matrices,
    tok_s_matrix,
)
from tasks.gate.lossless import LosslessTally
from tasks.gate.plan import (
    BREAKEVEN,
    CANDIDATE,
    CHALLENGER,
    INCUMBENT,
    NEW_DRAFT,
    POLICY,
    POLICY_BASELINE,
    BenchConfig,
    Incumbent,
    LeftOut,
    is_default_chain,
)
from tasks.gate.records import BenchResult, RequestRecord, pooled_accept_lengths


@dataclass
class ConfigSummary:
    name: str
    env_name: str
    baseline: bool
    spec: dict[str, Any] | None
    notes: list[str]
    role: str = CANDIDATE  # tasks.gate.plan: candidate | incumbent | challenger | scaling
    samples: int | None = None  # scaling drafts: their training sequences
    draft: str = NEW_DRAFT  # the contender whose draft it runs
    simulated_accept_length: float | None = None  # acceptance forced (break-even, rehearsal): filler outputs
    n_requests: int = 0
    n_errors: int = 0
    median_tok_s: float | None = None
    rep_medians: list[float] = field(default_factory=list)
    spread: float | None = None  # (max - min) of the repetition medians / overall median
    accept_length: float | None = None
    accept_length_per_domain: dict[str, float] = field(default_factory=dict)
    accept_per_position: list[float] | None = None
    exact_match_fraction: float | None = None
    n_compared: int = 0
    first_mismatch_min: int | None = None
    graph_problems: list[str] = field(default_factory=list)
    info_problems: list[str] = field(default_factory=list)
    launch_errors: list[str] = field(default_factory=list)
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    eligible: bool = False
    reasons: list[str] = field(default_factory=list)
    # The lossless rule's tally over the compared requests (a baseline's own reference launch
    # left out): exact, near_tie, not_lossless, no_evidence, compared; and a sentence per failure.
    lossless: dict[str, int] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)
    # The gate at load (tasks/gate/load.py): its figures per concurrency level (str keys), the
    # level its headline figures above are read at, and where it stops paying.
    levels: dict[str, LevelSummary] = field(default_factory=dict)
    headline_level: int = 1
    crossover: dict[str, Any] | None = None

    def is_candidate_chain(self) -> bool:
        """Our draft at topk 1 in the default environment (what replay predicts and the curve plots)."""
        return self.role == CANDIDATE and self.spec is not None and is_default_chain(self.env_name, self.spec["topk"])


@dataclass
class Contender:
    """One draft at its best config, beside the others (the report's contenders table): its best
    eligible config, or its fastest measured one when none is eligible."""

    name: str  # NEW_DRAFT, INCUMBENT or a challenger's name
    role: str
    config: str | None
    eligible: bool = False
    median_tok_s: float | None = None
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    accept_length: float | None = None
    accept_per_position: list[float] | None = None
    exact_match_fraction: float | None = None
    # Its median over the incumbent's best median, with the CI (paired by prompt); None for the
    # incumbent itself, and without an incumbent measured.
    vs_incumbent: list[float] | None = None
    reasons: list[str] = field(default_factory=list)


@dataclass
class GateDecision:
    outcome: str  # "promote" | "reject" | "stopped"
    best: str | None
    baseline: str | None
    speedup: float | None
    ci_low: float | None
    ci_high: float | None
    ci_level: float
    reasons: list[str]
    configs: list[ConfigSummary]
    thresholds: dict[str, Any]
    contenders: list[Contender] = field(default_factory=list)
    # The registry's promoted draft for this target, as measured: draft_id, uri, num_steps_from,
    # its best config and median, and the new draft's margin over it (with the CI) and whether
    # that margin is beyond the spread; "not_measured" says why when it gave no valid number.
    incumbent: dict[str, Any] | None = None
    left_out: list[dict[str, str]] = field(default_factory=list)  # LeftOut records
    breakeven: dict[str, Any] | None = None  # the server's measured break-even (tasks.gate.breakeven)
    # The serving policy the draft ships with (tasks/gate/serving_policy.py ServingPolicy.to_dict):
    # where it speculates, its SGLang adaptive config and vLLM schedule, and its own launch's
    # figures per level; None before the policy is judged.
    policy: dict[str, Any] | None = None

    @property
    def promote(self) -> bool:
        return self.outcome == "promote"

    def config(self, name: str | None) -> ConfigSummary | None:
        return next((c for c in self.configs if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, Any]:
        """The key numbers, for Slack and promoted.json's evidence."""
        best, base = self.config(self.best), self.config(self.baseline)
        return {
            "outcome": self.outcome,
            "best_config": self.best,
            "baseline_config": self.baseline,
            "baseline_median_tok_s": base.median_tok_s if base else None,
            "best_median_tok_s": best.median_tok_s if best else None,
            "speedup": self.speedup,
            "ci": [self.ci_low, self.ci_high],
            "ci_level": self.ci_level,
            "accept_length": best.accept_length if best else None,
            "exact_match_fraction": best.exact_match_fraction if best else None,
            "lossless": dict(best.lossless) if best else None,
            # What a later gate benchmarks this draft at when it is the incumbent (gate.incumbent: evidence).
            "best_spec": {k: best.spec[k] for k in ("num_steps", "topk", "num_draft_tokens")} if best and best.spec else None,
            "incumbent": self.incumbent,
            "contenders": [
                {k: v for k, v in asdict(c).items() if k not in ("accept_per_position", "reasons")} for c in self.contenders
            ],
            "left_out": list(self.left_out),
            "reasons": list(self.reasons),
            "deploy_concurrency": best.headline_level if best else None,
            "serving_policy": self.policy,
        }


def _resamplers(
    base: tuple[int, ...], spec: tuple[int, ...], n: int, seed: int
) -> tuple[Any, Any]:
    """The paired bootstrap's draws, for [launch, slot] matrices of these shapes: each of the n
    resamples draws the slots with replacement (the same for both sides: the comparison is paired
    by request) and each side's launches with replacement; each function maps a matrix of its
    side to its n resamples, [n, launches x slots]."""
    rng = np.random.default_rng(seed)
    slots = base[1]
    pi = rng.integers(0, slots, size=(n, slots))
    bi = rng.integers(0, base[0], size=(n, base[0]))
    si = rng.integers(0, spec[0], size=(n, spec[0]))
    return (lambda m: m[bi[:, :, None], pi[:, None, :]].reshape(n, -1),
            lambda m: m[si[:, :, None], pi[:, None, :]].reshape(n, -1))  # fmt: skip


def bootstrap_speedup(
    base: np.ndarray, spec: np.ndarray, n: int, level: float, seed: int
) -> tuple[float, float, float] | None:
    """(point, low, high) of median(spec) / median(base); None without data on both sides."""
    if np.all(np.isnan(base)) or np.all(np.isnan(spec)) or base.shape[1] != spec.shape[1]:
        return None
    pick_base, pick_spec = _resamplers(base.shape, spec.shape, n, seed)
    b, s = pick_base(base), pick_spec(spec)
    keep = ~(np.all(np.isnan(b), axis=1) | np.all(np.isnan(s), axis=1))
    ratio = np.nanmedian(s[keep], axis=1) / np.nanmedian(b[keep], axis=1)
    low, high = np.quantile(ratio, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(np.nanmedian(spec) / np.nanmedian(base)), float(low), float(high)


def bootstrap_rate_ratio(
    base: tuple[np.ndarray, np.ndarray], spec: tuple[np.ndarray, np.ndarray], n: int, level: float, seed: int
) -> tuple[float, float, float] | None:
    """(point, low, high) of pooled rate(spec) / pooled rate(base), a pooled rate being the tokens
    over the latency summed over the requests ([launch, slot] matrices, load.rate_matrices);
    request slots resampled for both sides, launches for each; None without data on both sides."""
    (bt, bl), (st, sl) = base, spec
    if np.all(np.isnan(bl)) or np.all(np.isnan(sl)) or bl.shape[1] != sl.shape[1]:
        return None
    pick_base, pick_spec = _resamplers(bl.shape, sl.shape, n, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = (np.nansum(pick_spec(st), axis=1) / np.nansum(pick_spec(sl), axis=1)) / (
            np.nansum(pick_base(bt), axis=1) / np.nansum(pick_base(bl), axis=1))  # fmt: skip
    ratio = ratio[np.isfinite(ratio)]
    low, high = np.quantile(ratio, [(1 - level) / 2, 1 - (1 - level) / 2])
    point = (np.nansum(st) / np.nansum(sl)) / (np.nansum(bt) / np.nansum(bl))
    return float(point), float(low), float(high)


def level_ratio(result: BenchResult, cfg: GateConfig, num: str, den: str, level: int) -> tuple[float, float, float] | None:
    """`num` over `den` at a load level, with the bootstrap CI: the median per-request tok/s at
    concurrency 1, the pooled rate above it (tasks/gate/load.py says why)."""
    n = result.columns(level)
    a, b = result.records(num, level), result.records(den, level)
    if level <= 1:
        return bootstrap_speedup(tok_s_matrix(b, n), tok_s_matrix(a, n), cfg.n_bootstrap, cfg.ci_level, cfg.bootstrap_seed)
    return bootstrap_rate_ratio(rate_matrices(b, n), rate_matrices(a, n), cfg.n_bootstrap, cfg.ci_level, cfg.bootstrap_seed)


def _per_position(records: list[RequestRecord]) -> list[float] | None:
    """P(the draft token at position k is accepted), k = 1.., from correct-drafts histograms."""
    hists = [r.correct_drafts_histogram for r in records if r.correct_drafts_histogram]
    if not hists:
        return None
    total = np.zeros(max(len(h) for h in hists))
    for h in hists:
        total[: len(h)] += h
    cycles = total.sum()
    return [float(total[k:].sum() / cycles) for k in range(1, len(total))] if cycles else None


def summarize(config: BenchConfig, result: BenchResult, level: int = 1) -> ConfigSummary:
    """One config's figures: per load level, and the headline ones (median, repetition medians,
    spread) at `level` (gate.deploy_concurrency), or at its lowest level when it did not measure
    that one (break-even and data-scaling launches measure the lowest only)."""
    records = result.records(config.name)
    launches = [x for x in result.launches if x.config == config.name]
    s = ConfigSummary(config.name, config.env_name, config.is_baseline,
                      asdict(config.spec) if config.spec else None, list(config.notes),
                      config.role, config.samples, config.draft, config.simulated_accept_length)  # fmt: skip
    s.n_requests, s.n_errors = len(records), sum(1 for r in records if r.error)
    s.graph_problems = sorted({p for x in launches for p in x.graph_problems})
    s.info_problems = sorted({p for x in launches for p in x.info_problems})
    s.launch_errors = [x.error.splitlines()[0] for x in launches if x.error]
    levels = measured_levels(result, config.name)
    s.levels = {str(c): level_summary(result, config.name, c) for c in levels}
    s.headline_level = level if level in levels or not levels else levels[0]
    m = tok_s_matrix(result.records(config.name, s.headline_level), result.columns(s.headline_level))
    if m.size and not np.all(np.isnan(m)):
        s.median_tok_s = float(np.nanmedian(m))
        s.rep_medians = [float(np.nanmedian(row)) for row in m if not np.all(np.isnan(row))]
        s.spread = (max(s.rep_medians) - min(s.rep_medians)) / s.median_tok_s
    ok = [r for r in records if r.error is None]
    s.accept_length, s.accept_length_per_domain = pooled_accept_lengths(records)
    s.accept_per_position = _per_position(ok)
    compared = [r for r in ok if r.exact_match is not None]
    s.n_compared = len(compared)
    if compared:
        s.exact_match_fraction = sum(1 for r in compared if r.exact_match) / len(compared)
        mismatches = [r.first_mismatch for r in compared if r.first_mismatch is not None]
        s.first_mismatch_min = min(mismatches) if mismatches else None
    tally = LosslessTally.of(ok)
    s.lossless = {"exact": tally.exact, "near_tie": tally.near_tie, "not_lossless": tally.not_lossless,
                  "no_evidence": tally.no_evidence, "compared": tally.compared}  # fmt: skip
    s.refusals = tally.refusals
    return s


def _eligibility(s: ConfigSummary, cfg: GateConfig) -> list[str]:
    reasons = list(s.launch_errors)
    if s.median_tok_s is None:
        reasons.append("no successful request")
    if s.n_errors:
        reasons.append(f"{s.n_errors} of {s.n_requests} requests failed")
    if cfg.require_cuda_graphs:
        reasons += s.graph_problems
    reasons += s.info_problems
    if s.role == BREAKEVEN:  # its outputs are filler by construction: it measures cost, never promoted
        return reasons + [f"simulated acceptance ({s.notes[0] if s.notes else 'SGLANG_SIMULATE_ACC_LEN'})"]
    if not s.baseline:
        if s.refusals:
            more = len(s.refusals) - 1
            reasons.append(s.refusals[0] + (f" (and {more} more request{'s' * (more > 1)} not lossless)" if more else ""))
        elif not s.lossless.get("compared") and s.simulated_accept_length is None:
            reasons.append("no output was compared with the baseline's")
        if s.accept_length is None or s.accept_length < cfg.acceptance_floor:
            reasons.append(f"accept length {s.accept_length} below the floor {cfg.acceptance_floor:g}")
    return reasons


def _figure(s: ConfigSummary) -> str:
    """The rate a config is judged on at its headline level, in words."""
    if s.headline_level > 1:
        return f"{_rate(s):.1f} tok/s a request pooled at concurrency {s.headline_level}"
    return f"median {s.median_tok_s:.1f} tok/s"


def _fmt(s: ConfigSummary, level: float) -> str:
    return f"{s.name}: {_figure(s)}, speedup {s.speedup:.3f}x ({level:.0%} CI {s.ci_low:.3f}-{s.ci_high:.3f})"


def _speed_verdict(s: ConfigSummary, cfg: GateConfig, versus: str) -> tuple[bool, str]:
    """(beats the baseline beyond the spread by at least min_speedup, the sentence that says so)."""
    assert s.speedup is not None and s.ci_low is not None and s.ci_high is not None
    if s.ci_high < 1.0:
        return False, f"slower than the baseline: {_fmt(s, cfg.ci_level)} {versus}"
    if s.ci_low <= 1.0:
        return False, f"within the run-to-run spread: {_fmt(s, cfg.ci_level)} {versus}; the CI includes 1.0"
    if s.speedup < cfg.min_speedup:
        return False, f"speedup below min_speedup {cfg.min_speedup:g}: {_fmt(s, cfg.ci_level)} {versus}"
    return True, f"faster than the baseline beyond the spread: {_fmt(s, cfg.ci_level)} {versus}"


def _rate(s: ConfigSummary) -> float:
    """What configs are ranked by at their headline level: the median per-request tok/s at
    concurrency 1, the pooled rate above it (the statistic their speedups are taken on)."""
    lv = s.levels.get(str(s.headline_level))
    if s.headline_level > 1 and lv is not None and lv.pooled_tok_s is not None:
        return lv.pooled_tok_s
    return s.median_tok_s or 0.0


def _best_of(summaries: list[ConfigSummary], draft: str) -> ConfigSummary | None:
    """A contender's best config: its eligible one of the highest median with a speedup."""
    eligible = [s for s in summaries if s.draft == draft and not s.baseline and s.role != POLICY and s.eligible
                and s.speedup is not None]  # fmt: skip
    return max(eligible, key=_rate) if eligible else None


def _ratio(result: BenchResult, cfg: GateConfig, num: ConfigSummary, den: ConfigSummary) -> tuple[float, float, float] | None:
    """median(num) / median(den) with its bootstrap CI at the headline level, paired by request
    slot as the speedup is."""
    return level_ratio(result, cfg, num.name, den.name, num.headline_level)


def _margin(r: tuple[float, float, float], level: float) -> str:
    return f"{r[0]:.3f}x ({level:.0%} CI {r[1]:.3f}-{r[2]:.3f})"


def _contenders(summaries: list[ConfigSummary], result: BenchResult, cfg: GateConfig) -> list[Contender]:
    """The run's draft, the incumbent and each challenger at its best config, with its margin
    over the incumbent's best."""
    names = dict.fromkeys(s.draft for s in summaries if not s.baseline and s.role in (CANDIDATE, INCUMBENT, CHALLENGER))
    inc = _best_of(summaries, INCUMBENT)
    out = []
    for name in names:
        mine = [s for s in summaries if s.draft == name and not s.baseline and s.role not in (BREAKEVEN, POLICY)]
        measured = [s for s in mine if s.median_tok_s is not None]
        best = _best_of(summaries, name) or (max(measured, key=_rate) if measured else None)
        c = Contender(name, mine[0].role, best.name if best else None)
        if best is None:
            c.reasons = sorted({r for s in mine for r in s.reasons}) or ["not measured"]
        else:
            c.eligible, c.reasons = best.eligible, list(best.reasons)
            for k in ("median_tok_s", "speedup", "ci_low", "ci_high", "accept_length", "accept_per_position",
                      "exact_match_fraction"):  # fmt: skip
                setattr(c, k, getattr(best, k))
            if inc is not None and name != INCUMBENT and (r := _ratio(result, cfg, best, inc)) is not None:
                c.vs_incumbent = list(r)
        out.append(c)
    return out


def _against_incumbent(
    decision: GateDecision, summaries: list[ConfigSummary], cfg: GateConfig,
    incumbent: Incumbent, best: ConfigSummary | None, wins: bool,
) -> str | None:  # fmt: skip
    """Record the incumbent's numbers and the new draft's margin over it in the decision; turn a
    win over the baseline into a reject when the margin is not beyond the spread. Returns the
    sentence for the decision's reasons."""
    inc = _best_of(summaries, INCUMBENT)
    record: dict[str, Any] = {"draft_id": incumbent.draft_id, "uri": incumbent.uri,
                              "num_steps_from": incumbent.num_steps_from, "config": inc.name if inc else None,
                              "median_tok_s": inc.median_tok_s if inc else None}  # fmt: skip
    decision.incumbent = record
    if inc is None:
        why = "; ".join(f"{s.name}: {'; '.join(s.reasons)}" for s in summaries if s.draft == INCUMBENT and not s.baseline)
        record["not_measured"] = why or "no config measured"
        return f"the incumbent {incumbent.draft_id} gave no valid measurement ({record['not_measured']}): judged against the baseline alone"
    # The margin _contenders already bootstrapped for the new draft's best config (same pairing, same seed).
    mine = next((c for c in decision.contenders if c.name == NEW_DRAFT and best is not None and c.config == best.name), None)
    if mine is None or mine.vs_incumbent is None:
        return None
    r = (mine.vs_incumbent[0], mine.vs_incumbent[1], mine.vs_incumbent[2])
    record.update(margin=r[0], ci=[r[1], r[2]], beaten=r[1] > 1.0)
    versus = (f"{best.name} median {best.median_tok_s:.1f} tok/s vs the incumbent {incumbent.draft_id}'s "
              f"{inc.name} {inc.median_tok_s:.1f} tok/s: margin {_margin(r, cfg.ci_level)}")  # fmt: skip
    if r[1] > 1.0:
        return f"faster than the incumbent beyond the spread: {versus}"
    if wins:
        decision.outcome = "reject"
    where = "slower than" if r[2] < 1.0 else "not faster beyond the spread than"
    return f"{where} the incumbent: {versus}" + ("" if r[2] < 1.0 else "; the CI includes 1.0")


def _challengers_faster(summaries: list[ConfigSummary], result: BenchResult, cfg: GateConfig, best: ConfigSummary) -> list[str]:
    """A sentence for each challenger whose best median tops the new draft's: reported, never
    promoted in its place."""
    lines = []
    for name in dict.fromkeys(s.draft for s in summaries if s.role == CHALLENGER):
        ch = _best_of(summaries, name)
        if ch is None or _rate(ch) <= _rate(best) or (r := _ratio(result, cfg, ch, best)) is None:
            continue
        spread = "beyond the spread" if r[1] > 1.0 else "within the spread: the CI includes 1.0"
        lines.append(f"a challenger is faster: {ch.name} median {ch.median_tok_s:.1f} tok/s, {_margin(r, cfg.ci_level)} "
                     f"the new draft's best {best.name} ({spread}); it is never promoted in its place")  # fmt: skip
    return lines


def baseline_warnings(summaries: list[ConfigSummary]) -> list[str]:
    """Loud sentences for baselines whose later launches are not lossless against their first:
    the speculative configs are then judged against noise beyond the threshold."""
    return [f"WARNING: baseline-vs-baseline is not lossless ({s.name}: {s.lossless['not_lossless'] + s.lossless['no_evidence']} "
            f"of {s.lossless['compared']} requests): the threshold (gate.near_tie_nats) or the server is off; "
            f"first: {s.refusals[0]}" for s in summaries if s.baseline and s.refusals]  # fmt: skip


def decide(
    result: BenchResult, cfg: GateConfig, incumbent: Incumbent | None = None, left_out: Sequence[LeftOut] = ()
) -> GateDecision:
    """The decision over a benchmark. `incumbent`: the registry's draft for this target when the
    benchmark measured it (its configs have role INCUMBENT); `left_out`: contenders not measured."""
    decision = _decide(result, cfg, incumbent, left_out)
    decision.reasons += baseline_warnings(decision.configs)
    draft = {s.spec["num_steps"]: (s.name, s.accept_length) for s in decision.configs if s.spec and s.is_candidate_chain()}
    decision.breakeven = measure_breakeven(result, draft, cfg.breakeven_prompts)
    return decision


def level_speedups(result: BenchResult, cfg: GateConfig, s: ConfigSummary, base: ConfigSummary | None) -> None:
    """`s`'s speedup over `base` at each level both measured (bootstrap CI, paired by request
    slot), its headline speedup (at its headline level) and where it stops paying."""
    if base is None:
        return
    for level in s.levels.values():
        ci = level_ratio(result, cfg, s.name, base.name, level.level)
        if ci is not None:
            level.speedup, level.ci_low, level.ci_high = ci
            if level.level == s.headline_level:
                s.speedup, s.ci_low, s.ci_high = ci
    if len(s.levels) > 1:
        s.crossover = crossover({v.level: v for v in s.levels.values()})


def _decide(result: BenchResult, cfg: GateConfig, incumbent: Incumbent | None, left_out: Sequence[LeftOut]) -> GateDecision:
    summaries = [summarize(c, result, cfg.deploy_level) for c in result.configs]
    thresholds = {k: getattr(cfg, k) for k in ("min_speedup", "ci_level", "n_bootstrap", "bootstrap_seed",
                                              "acceptance_floor", "near_tie_nats", "top_logprobs_num",
                                              "frequency_penalty", "require_cuda_graphs", "repetitions",
                                              "concurrency", "deploy_concurrency")}  # fmt: skip
    decision = GateDecision("reject", None, None, None, None, None, cfg.ci_level, [], summaries, thresholds)
    decision.left_out = [asdict(x) for x in left_out]
    for s in summaries:
        s.reasons = _eligibility(s, cfg)
        s.eligible = not s.reasons
    if result.stopped:
        decision.outcome, decision.reasons = "stopped", [result.stopped]
        return decision
    baselines = [s for s in summaries if s.baseline and s.eligible and s.role != POLICY]
    if not baselines:
        decision.reasons = ["no valid baseline: " + "; ".join(f"{s.name}: {', '.join(s.reasons)}" for s in summaries if s.baseline)]
        return decision
    # The reference is the fastest non-speculative deployment found, whatever its environment.
    ref = max(baselines, key=_rate)
    decision.baseline = ref.name
    policy_base = next((s for s in summaries if s.name == POLICY_BASELINE and s.eligible), None)
    for s in summaries:
        if not s.baseline:
            level_speedups(result, cfg, s, policy_base if s.role == POLICY else ref)
    decision.contenders = _contenders(summaries, result, cfg)
    # Only the run's own draft can be promoted; the incumbent, challengers and scaling drafts are measured beside it.
    best = _best_of(summaries, NEW_DRAFT)
    versus = f"vs {ref.name} {_figure(ref)}"
    if best is None:
        decision.reasons = ["no speculative config is eligible"] + [
            f"{s.name}: {'; '.join(s.reasons)}" for s in summaries if not s.baseline and s.role == CANDIDATE
        ]
        # How fast it would have been, had it been eligible: a rejection for its outputs reads
        # differently when the draft is also slower than the baseline (or faster).
        measured = [s for s in summaries if s.role == CANDIDATE and not s.baseline and s.ci_high is not None]
        if measured:
            fastest = max(measured, key=_rate)
            decision.reasons.append(f"fastest measured (not eligible): {_speed_verdict(fastest, cfg, versus)[1]}")
        if incumbent is not None:
            _against_incumbent(decision, summaries, cfg, incumbent, None, False)
        return decision
    assert best.speedup is not None and best.ci_low is not None and best.ci_high is not None
    decision.best, decision.speedup, decision.ci_low, decision.ci_high = best.name, best.speedup, best.ci_low, best.ci_high
    wins, reason = _speed_verdict(best, cfg, versus)
    if wins:
        decision.outcome = "promote"
        n = best.lossless
        reason += f"; accept length {best.accept_length:.2f}"
        if best.simulated_accept_length is None:  # forced acceptance answers filler: nothing to compare
            reason += (f"; outputs lossless: {n['exact']} of {n['compared']} exact, "
                       f"{n['near_tie']} first leaving the baseline's at a near-tie")  # fmt: skip
    decision.reasons = [reason]
    if incumbent is not None and (line := _against_incumbent(decision, summaries, cfg, incumbent, best, wins)):
        decision.reasons.append(line)
    decision.reasons += _challengers_faster(summaries, result, cfg, best)
    return decision
